"""The cost model's view of a video DiT step (``dspzoo plan``, the harness's bytes): STDiT,
Latte and Latte-1, registered with :func:`~dspzoo.core.costmodel.workload.register_workload`
by the package.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dspzoo.core.costmodel.workload import StageSpec, Workload
from dspzoo.core.parallel.plan import Stage

from ...core.errors import UsageError
from .latte import Latte
from .latte1 import SEQ_DIMS, Latte1, Latte1Config
from .stdit import layer_stages


def latte1_workload(
    name: str,
    config: Latte1Config,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    context: int = 0,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step on ``frames`` latent frames (``config.video_length``, or 1: image mode) of a
    ``spatial`` latent ``(H, W)`` (default ``sample_size`` square), cross-attending to
    ``context`` caption tokens.

    Every layer is one spatial/temporal pair as :class:`~.latte1.Latte1` runs it (one
    ``block{i}`` region): spatial self-attention over ``s`` (adaLN-modulated and gated), the
    caption cross-attention (no norm, no gate; only when ``cross_attention``), the spatial MLP,
    temporal self-attention over ``t``, the temporal MLP; one Megatron pair per attention and
    MLP. The exit gathers ``p·p·channels_out`` outputs per token.
    """
    if unused.get("seq_len") is not None:
        raise UsageError(f"{name} is a video model: give --frames and --size/--latent")
    frames = 1 if frames is None else frames
    if frames not in (1, config.video_length):
        raise UsageError(
            f"{name} takes video_length={config.video_length} latent frames or 1 (an image); "
            f"got --frames {frames}"
        )
    size = config.sample_size if spatial is None else spatial
    h, w = (size, size) if isinstance(size, int) else size
    p = config.patch
    spatial_attn, cross, spatial_mlp, temporal_attn, temporal_mlp = Latte1.STAGES
    layer = (
        StageSpec(spatial_attn, attention=("s",), tp_pairs=1),
        *((StageSpec(cross, cross=True, adaln=False),) if config.cross_attention else ()),
        StageSpec(spatial_mlp, mlp=True, tp_pairs=1),
        StageSpec(temporal_attn, attention=("t",), tp_pairs=1),
        StageSpec(temporal_mlp, mlp=True, tp_pairs=1),
    )
    return Workload(
        name=name,
        family="latte1",
        batch=batch,
        dims=SEQ_DIMS,
        lengths=(frames, (h // p) * (w // p)),
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.heads,
        mlp_hidden=4 * config.hidden,
        layers=(layer,) * config.depth,
        period=Latte1.STAGES,
        in_width=config.in_channels * p * p,
        exit_width=config.channels_out * p * p,
        loss_on_shard=True,  # training's flow MSE runs on each rank's tokens
        context=context if config.cross_attention else 0,
        cond_dim=config.caption_channels,
        params=params,
        itemsize=itemsize,
    )


def _stdit_layers(config: Any) -> tuple[tuple[tuple[StageSpec, ...], ...], tuple[Stage, ...]]:
    k = config.full_attention_every

    def layer(full: bool, tag: str) -> tuple[StageSpec, ...]:
        stages = layer_stages(full, tag)
        specs = []
        for st in stages:
            if st.mixes:
                specs.append(StageSpec(st, attention=st.mixes, tp_pairs=1))
            elif st.name.startswith("cross"):
                specs.append(StageSpec(st, cross=bool(config.cond_dim), adaln=False))
            else:
                specs.append(StageSpec(st, mlp=True, tp_pairs=1))
        return tuple(specs)

    if k:
        period = tuple(s for j in range(k) for s in layer_stages(j == k - 1, f"@{j}"))
        layers = tuple(layer(i % k == k - 1, f"@{i % k}") for i in range(config.depth))
    else:
        period = layer_stages(False)
        layers = tuple(layer(False, "") for _ in range(config.depth))
    return layers, period


def _latte_layers(config: Any) -> tuple[tuple[tuple[StageSpec, ...], ...], tuple[Stage, ...]]:
    period = Latte.STAGES
    by_name = {s.name: s for s in period}
    layers = []
    for i in range(config.depth):
        kind, dim = ("spatial", "s") if i % 2 == 0 else ("temporal", "t")
        layers.append(
            (
                StageSpec(by_name[f"{kind}_attn"], attention=(dim,), tp_pairs=1),
                StageSpec(by_name[f"{kind}_cross"], cross=bool(config.cond_dim), adaln=False),
                StageSpec(by_name[f"{kind}_mlp"], mlp=True, tp_pairs=1),
            )
        )
    return tuple(layers), period


def video_workload(
    name: str,
    config: Any,
    *,
    frames: int,
    spatial: int | tuple[int, int],
    batch: int = 1,
    context: int = 0,
    itemsize: int = 4,
    params: int = 0,
) -> Workload:
    """Workload of an STDiT / Latte step on ``frames`` latent frames of ``spatial`` latent size.

    ``spatial``: the latent ``(H, W)`` (or ``H`` for square); token lengths are
    ``T' = frames / pt`` and ``S = (H/ph)·(W/pw)``. ``context``: conditioning tokens (0 = none).
    """
    family = name.split("-", 1)[0].lower()
    h, w = (spatial, spatial) if isinstance(spatial, int) else spatial
    pt, ph, pw = config.patch
    t_tokens, s_tokens = frames // pt, (h // ph) * (w // pw)
    layers, period = (_latte_layers if family == "latte" else _stdit_layers)(config)
    patch = pt * ph * pw
    return Workload(
        name=name,
        family=family,
        batch=batch,
        dims=("t", "s"),
        lengths=(t_tokens, s_tokens),
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=layers,
        period=period,
        in_width=config.in_channels * patch,
        exit_width=config.out_channels * patch,
        loss_on_shard=True,  # training's flow MSE runs on each rank's tokens
        causal=False,
        context=context if config.cond_dim else 0,
        cond_dim=config.cond_dim,
        params=params,
        itemsize=itemsize,
    )


def video_tokens_workload(
    name: str, config: Any, *, t: int, s: int, batch: int = 1, **kwargs: Any
) -> Workload:
    """Like :func:`video_workload` with the token lengths ``T'`` and ``S`` given directly."""
    wl = video_workload(name, config, frames=config.patch[0], spatial=1, batch=batch, **kwargs)
    return replace(wl, lengths=(t, s))


def dit_workload(
    name: str,
    config: Any,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    context: int = 0,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """The registered builder of ``stdit`` and ``latte``: :func:`video_workload` after checking
    that the video sizes were given."""
    if frames is None or spatial is None:
        raise UsageError(f"{name} is a video model: give frames and spatial (latent size)")
    return video_workload(
        name, config, frames=frames, spatial=spatial, batch=batch, context=context,
        itemsize=itemsize, params=params,
    )  # fmt: skip

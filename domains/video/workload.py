"""The cost model's view of a Latte-1 step (``dspzoo plan latte1-...``, the harness's bytes).

Registered with :func:`~dspzoo.core.costmodel.workload.register_workload` by the package (the
cost model describes ``stdit`` and ``latte`` itself).
"""

from __future__ import annotations

from typing import Any

from dspzoo.core.costmodel.workload import StageSpec, Workload

from .latte1 import SEQ_DIMS, Latte1, Latte1Config


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
        raise ValueError(f"{name} is a video model: give --frames and --size/--latent")
    frames = 1 if frames is None else frames
    if frames not in (1, config.video_length):
        raise ValueError(
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
        context=context if config.cross_attention else 0,
        cond_dim=config.caption_channels,
        params=params,
        itemsize=itemsize,
    )

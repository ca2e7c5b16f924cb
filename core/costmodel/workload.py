"""A model config plus a workload → the shapes every cost formula needs.

A :class:`Workload` is the cost model's whole view of one training (or inference) step: the
batch, the sequence dims and their lengths, the width, heads and key/value heads, the MLP
width, and the model's layers as the *same* :class:`~dspzoo.core.plan.Stage` s the runtime
plans with — each annotated with what runs inside it (:class:`StageSpec`: a self-attention
over which dims, how many Megatron linear pairs, a cross-attention, an MLP). Nothing here
imports torch modules of the models: shapes come from the config dataclasses alone, so the
720M/3B configs cost nothing to describe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..plan import Stage

# family -> builder(name, config, *, batch, frames, spatial, seq_len, context, itemsize, params)
_BUILDERS: dict[str, Callable[..., Workload]] = {}


def register_workload(family: str, builder: Callable[..., Workload]) -> None:
    """Let :func:`workload_for` (and ``dspzoo plan``) describe the models of ``family``.

    ``builder(name, config, *, batch, frames, spatial, seq_len, context, itemsize, params)``
    returns the :class:`Workload` of one step (the arguments ``workload_for`` was given; a
    builder raises ``ValueError`` naming the ones its family needs).
    """
    _BUILDERS[family] = builder


@dataclass(frozen=True)
class StageSpec:
    """One stage of one layer, as the runtime meets it.

    Attributes:
        stage: the planner's :class:`Stage` (its ``name`` is what ``sp.to_stage`` is called with).
        attention: the dims its self-attention attends over (``()``: no self-attention).
        tp_pairs: Megatron linear pairs (column → row) it runs under ``megatron_sp``.
        cross: it holds a cross-attention to replicated conditioning tokens.
        mlp: it holds the token-wise MLP.
        adaln: the attention/MLP input is adaLN-modulated and the output gated (video DiTs).
    """

    stage: Stage
    attention: tuple[str, ...] = ()
    tp_pairs: int = 0
    cross: bool = False
    mlp: bool = False
    adaln: bool = True

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class Workload:
    """Shapes of one step of one model (see the module docstring).

    ``lengths`` are token lengths (after patching). ``in_width`` / ``exit_width`` are the
    elements per token entering the model and gathered at its exit (patch dims for video,
    1 byte id and ``vocab`` logits for text). ``context`` conditioning tokens feed every
    cross-attention. ``itemsize`` is the activation dtype's bytes (2 for bf16 training).
    """

    name: str
    family: str
    batch: int
    dims: tuple[str, ...]
    lengths: tuple[int, ...]
    hidden: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    layers: tuple[tuple[StageSpec, ...], ...]
    period: tuple[Stage, ...]
    in_width: int
    exit_width: int
    causal: bool = False
    context: int = 0
    cond_dim: int = 0
    params: int = 0
    itemsize: int = 4
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """Tokens per sample (the product of the sequence lengths)."""
        return math.prod(self.lengths)

    @property
    def depth(self) -> int:
        return len(self.layers)

    def length(self, dim: str) -> int:
        return self.lengths[self.dims.index(dim)]

    def with_(self, **changes: Any) -> Workload:
        """A copy with fields replaced (e.g. ``itemsize=2``, ``batch=4``)."""
        return replace(self, **changes)


# -- video DiTs ------------------------------------------------------------------------------
def _stdit_layers(config: Any) -> tuple[tuple[tuple[StageSpec, ...], ...], tuple[Stage, ...]]:
    from dspzoo.domains.video.stdit import layer_stages

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
    from dspzoo.domains.video.latte import Latte

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


# -- byte LM ---------------------------------------------------------------------------------
def text_workload(
    name: str,
    config: Any,
    *,
    seq_len: int,
    batch: int = 1,
    itemsize: int = 4,
    params: int = 0,
) -> Workload:
    """Workload of a ByteLM step on ``batch`` sequences of ``seq_len`` bytes."""
    from dspzoo.domains.text.model import STAGES

    attn = replace(STAGES[0], heads=config.heads)
    period = (attn, STAGES[1])
    layer = (
        StageSpec(attn, attention=("l",), tp_pairs=1, adaln=False),
        StageSpec(STAGES[1], mlp=True, tp_pairs=1, adaln=False),
    )
    return Workload(
        name=name,
        family="bytelm",
        batch=batch,
        dims=("l",),
        lengths=(seq_len,),
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.num_kv_heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=tuple(layer for _ in range(config.depth)),
        period=period,
        in_width=1,
        exit_width=config.vocab_size,
        causal=True,
        params=params,
        itemsize=itemsize,
        extra={"checkpoint": config.checkpoint, "vocab": config.vocab_size},
    )


def count_params(name: str, **overrides: Any) -> int:
    """Parameters of zoo model ``name`` (built on the meta device: no memory)."""
    from dspzoo.zoo import count_parameters, create_model

    return count_parameters(create_model(name, device="meta", **overrides))


def workload_for(
    name: str,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    seq_len: int | None = None,
    context: int = 0,
    itemsize: int = 4,
    overrides: dict[str, Any] | None = None,
) -> Workload:
    """The workload of zoo model ``name`` (e.g. ``"stdit-720M"``, ``"bytelm-lss-12l"``).

    Video models take ``frames`` (latent frames) and ``spatial`` (latent size); text models
    ``seq_len``. ``overrides`` replace config fields (as ``create_model`` does).
    """
    import dspzoo.domains.text  # noqa: F401  (register the families)
    import dspzoo.domains.video  # noqa: F401
    from dspzoo.zoo.registry import get_config, override_config, resolve_name

    name = resolve_name(name)
    config = override_config(get_config(name), **(overrides or {}))
    params = count_params(name, **(overrides or {}))
    family = name.split("-", 1)[0]
    if family == "bytelm":
        if seq_len is None:
            raise ValueError(f"{name} is a text model: give seq_len")
        return text_workload(
            name, config, seq_len=seq_len, batch=batch, itemsize=itemsize, params=params
        )
    if family in ("stdit", "latte"):
        if frames is None or spatial is None:
            raise ValueError(f"{name} is a video model: give frames and spatial (latent size)")
        return video_workload(
            name,
            config,
            frames=frames,
            spatial=spatial,
            batch=batch,
            context=context,
            itemsize=itemsize,
            params=params,
        )
    if family in _BUILDERS:
        return _BUILDERS[family](
            name,
            config,
            batch=batch,
            frames=frames,
            spatial=spatial,
            seq_len=seq_len,
            context=context,
            itemsize=itemsize,
            params=params,
        )
    raise ValueError(f"the cost model does not describe the {family!r} family yet")

"""The cost model's view of a ByteLM step (``dspzoo plan bytelm-...``, the harness's bytes),
registered with :func:`~dspzoo.core.costmodel.workload.register_workload` by the package."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dspzoo.core.costmodel.workload import StageSpec, Workload

from ...core.errors import UsageError
from .model import STAGES


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
    attn = replace(STAGES[0], heads=config.heads)
    period = (attn, STAGES[1])
    layer = (
        StageSpec(attn, attention=("l",), tp_pairs=1, adaln=False, pre_norm=True),
        StageSpec(STAGES[1], mlp=True, tp_pairs=1, adaln=False, pre_norm=True),
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
        loss_on_shard=True,  # training's cross-entropy runs on each rank's logits
        causal=True,
        params=params,
        itemsize=itemsize,
        extra={"checkpoint": config.checkpoint, "vocab": config.vocab_size},
    )


def lm_workload(
    name: str,
    config: Any,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """The registered builder of ``bytelm``: :func:`text_workload` after checking ``seq_len``."""
    if seq_len is None:
        raise UsageError(f"{name} is a text model: give seq_len")
    return text_workload(
        name, config, seq_len=seq_len, batch=batch, itemsize=itemsize, params=params
    )

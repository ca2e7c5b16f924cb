"""The cost model's view of a :class:`~.model.Toy2DTransformer` step (``dspzoo plan``).

Registered with :func:`~dspzoo.core.costmodel.workload.register_workload` by the package:
``dspzoo plan toy2d-small --dims t=16,s=64`` (or ``--frames 16 --latent 64``).
"""

from __future__ import annotations

import math
from typing import Any

from dspzoo.core.costmodel.workload import StageSpec, Workload

from ...core.errors import UsageError
from .model import SEQ_DIMS, STAGES, Toy2DConfig


def toy_workload(
    name: str,
    config: Toy2DConfig,
    *,
    batch: int = 1,
    frames: int | None = None,
    spatial: int | tuple[int, int] | None = None,
    itemsize: int = 4,
    params: int = 0,
    **unused: Any,
) -> Workload:
    """One step on ``[batch, T, S, in_channels]``: ``T = frames`` (default ``config.max_t``),
    ``S = spatial`` tokens (an ``(h, w)`` pair counts ``h·w``; default ``config.max_s``).
    Every layer: attention over ``s``, attention over ``t``, the MLP (no adaLN)."""
    if unused.get("seq_len") is not None:
        raise UsageError(f"{name} has token dims (t, s): give --dims t=…,s=… , not --seq-len")
    t = config.max_t if frames is None else frames
    s = config.max_s if spatial is None else math.prod(_pair(spatial))
    layer = (
        StageSpec(STAGES[0], attention=("s",), tp_pairs=1, adaln=False),
        StageSpec(STAGES[1], attention=("t",), tp_pairs=1, adaln=False),
        StageSpec(STAGES[2], mlp=True, tp_pairs=1, adaln=False),
    )
    return Workload(
        name=name,
        family="toy2d",
        batch=batch,
        dims=SEQ_DIMS,
        lengths=(t, s),
        hidden=config.hidden,
        heads=config.heads,
        kv_heads=config.heads,
        mlp_hidden=int(config.hidden * config.mlp_ratio),
        layers=(layer,) * config.depth,
        period=STAGES,
        in_width=config.in_channels,
        exit_width=config.in_channels,
        loss_on_shard=True,  # scripts/dsp_demo.py: the MSE on each rank's shard
        params=params,
        itemsize=itemsize,
    )


def _pair(spatial: int | tuple[int, int]) -> tuple[int, ...]:
    return (spatial,) if isinstance(spatial, int) else tuple(spatial)

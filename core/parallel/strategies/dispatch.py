"""Run a stage's attention: locally, or through the embedded method its plan step names.

The model calls ``sp.attention(q, k, v, act.spec, over=...)`` the same way under every
strategy. If the sharded dim is not among the attended dims, attention is local (DSP's normal
case). Otherwise the method in force (``spec.method``, set by ``sp.to_stage`` from the plan)
communicates: the attended dims are flattened with the sharded dim outermost, so every rank
holds one contiguous piece of the attended sequence, and the other sequence dims fold into the
batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..layout import SeqSpec
from ..methods.registry import get_method
from .base import fold_attention_dims, local_attention, unfold_attention_dims

if TYPE_CHECKING:
    from ..runtime import SeqParallel


def sharded_attention(
    sp: SeqParallel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: SeqSpec,
    over: str | tuple[str, ...],
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over ``over`` of ``[B, *seq_local, H, D]`` tensors laid out as ``spec``."""
    over = (over,) if isinstance(over, str) else tuple(over)
    for name in over:
        spec.index(name)  # clear error for unknown dims
    sharded = spec.sharded
    if sp.size == 1 or sharded is None or sharded not in over:
        return local_attention(q, k, v, spec, over, mask, causal, scale)
    method = spec.method
    if method == "local":
        raise RuntimeError(
            f"{sp.strategy.name}: attention over {over}{sp.stage_words()} while {sharded!r} "
            f"is sharded and the stage's plan says 'local'; call sp.to_stage() for this stage "
            f"first, or declare that the stage mixes {over}"
        )
    if mask is not None:
        raise NotImplementedError(
            f"an attention mask with the {method!r} method (attention over the sharded dim "
            f"{sharded!r}) is not supported; use causal=True, or a DSP plan that keeps "
            f"{sharded!r} whole for this stage"
        )
    if causal and len(over) > 1:
        raise ValueError(f"causal attention over several dims {over} is not defined")
    order = (sharded, *[d for d in over if d != sharded])
    rest = math.prod(spec.length(d) for d in order[1:])
    seq_lengths = [s * rest for s in spec.shard_lengths(sharded, sp.size)]
    # the zigzag positions describe one dim; several dims are attended without a mask, where
    # any consistent order of the keys gives the same result
    layout = spec.layout if len(order) == 1 else "contiguous"
    qf, moved = fold_attention_dims(q, spec, order)
    kf, _ = fold_attention_dims(k, spec, order)
    vf, _ = fold_attention_dims(v, spec, order)
    out = get_method(method).attention(sp, qf, kf, vf, seq_lengths, causal, scale, layout)
    return unfold_attention_dims(out, moved, spec, order)

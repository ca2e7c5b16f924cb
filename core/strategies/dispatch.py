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

from ..layout import SeqSpec, shard_sizes
from .base import fold_attention_dims, local_attention, unfold_attention_dims

if TYPE_CHECKING:
    from ..runtime import SeqParallel


def _usp_split(seq_lengths: list[int], ulysses: int, sp_rank: int) -> tuple[list[int], list[int]]:
    """USP's view of an SP split: per-ring-slot segments, and this slot's per-Ulysses-rank split."""
    segments = [sum(seq_lengths[j : j + ulysses]) for j in range(0, len(seq_lengths), ulysses)]
    slot = sp_rank // ulysses
    return segments, seq_lengths[slot * ulysses : (slot + 1) * ulysses]


def run_method(
    method: str,
    sp: SeqParallel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Call the embedded attention method ``method`` on folded ``[Bf, L_local, H, D]`` tensors."""
    from .. import methods

    if method == "ulysses":
        return methods.ulysses_attention(
            q, k, v, group=sp.group, seq_lengths=seq_lengths, causal=causal, scale=scale
        )
    if method == "ring":
        return methods.ring_attention(
            q,
            k,
            v,
            group=sp.group,
            seq_lengths=seq_lengths,
            causal=causal,
            scale=scale,
            layout=layout,
        )
    if method == "lss":
        return methods.lss_attention(
            q, k, v, group=sp.group, seq_lengths=seq_lengths, causal=causal, scale=scale
        )
    if method == "usp":
        mesh = sp.mesh
        ulysses = 1 if mesh is None else mesh.ulysses_size
        segments, split = _usp_split(seq_lengths, ulysses, sp.rank)
        if causal and split != shard_sizes(sum(split), ulysses):
            raise ValueError(f"usp: causal attention needs a balanced split, got {split}")
        return methods.usp_attention(
            q,
            k,
            v,
            ulysses_group=None if mesh is None else mesh.ulysses_group,
            ring_group=sp.group if ulysses == 1 else mesh.ring_group,
            seq_lengths=segments,
            causal=causal,
            scale=scale,
            ulysses_lengths=split,
        )
    if method == "megatron_sp":
        raise RuntimeError(
            "megatron_sp: this attention mixes the sharded dim, but the model did not gather "
            "the sequence first; tensor-parallel models declare TP_PLAN on their projection "
            "modules and call sp.tp_enter / sp.tp_exit around them (see core/layers/attention.py)"
        )
    raise ValueError(f"unknown attention method {method!r}")


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
            f"{sp.strategy.name}: attention over {over} while {sharded!r} is sharded and the "
            f"stage's plan says 'local'; call sp.to_stage() for this stage first, or declare "
            f"that the stage mixes {over}"
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
    out = run_method(method, sp, qf, kf, vf, seq_lengths, causal, scale, layout)
    return unfold_attention_dims(out, moved, spec, order)

"""What a sequence-parallel strategy decides (the plan), and attention over local dims."""

from __future__ import annotations

import math

import torch

from ...layers.attention import attend
from ..layout import SeqSpec
from ..plan import Plan, Stage


class Strategy:
    """A planning policy: which dim is sharded during each stage, and which method runs it.

    The runtime does the rest generically: ``to_stage`` switches to the planned dim and puts
    the planned method in force; ``attention`` runs locally or through that method.
    """

    name = "base"

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        raise NotImplementedError


def fold_attention_dims(
    x: torch.Tensor, spec: SeqSpec, over: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Size]:
    """``[*lead, *seq, H, D]`` → ``[lead·others, L_over, H, D]`` and the permuted shape.

    The ``over`` dims (in the order given) are flattened into one attended sequence; the
    other sequence dims fold into the batch.
    """
    first, count = spec.first_axis, len(spec.names)
    if x.dim() != first + count + 2:
        raise ValueError(
            f"attention expects [B, *{spec.names}, heads, head_dim] tensors, got shape "
            f"{tuple(x.shape)}"
        )
    over_axes = [spec.axis(d) for d in over]
    others = [first + i for i, n in enumerate(spec.names) if n not in over]
    perm = [*range(first), *others, *over_axes, x.dim() - 2, x.dim() - 1]
    moved = x.permute(perm)
    batch = math.prod(moved.shape[: first + len(others)])
    length = math.prod(moved.shape[first + len(others) : first + count])
    # the batch spelled out, not -1: an empty shard (a dim shorter than the SP size) has
    # length 0, which leaves -1 ambiguous
    return moved.reshape(batch, length, *moved.shape[-2:]), moved.shape


def unfold_attention_dims(
    out: torch.Tensor, moved_shape: torch.Size, spec: SeqSpec, over: tuple[str, ...]
) -> torch.Tensor:
    """Inverse of :func:`fold_attention_dims` (``out`` may have other heads/head-dim sizes)."""
    first = spec.first_axis
    over_axes = [spec.axis(d) for d in over]
    others = [first + i for i, n in enumerate(spec.names) if n not in over]
    perm = [*range(first), *others, *over_axes]
    shape = (*moved_shape[:-2], *out.shape[-2:])
    y = out.reshape(shape)
    inverse = [0] * (len(perm) + 2)
    for position, axis in enumerate([*perm, len(perm), len(perm) + 1]):
        inverse[axis] = position
    return y.permute(inverse)


def fold_mask(mask: torch.Tensor, q: torch.Tensor, spec: SeqSpec, over: tuple[str, ...]):
    """A mask broadcastable to ``[*lead, H, Lq, Lk]`` → ``[lead·others, H|1, Lq|1, Lk]``.

    ``lead`` are the axes before the first sequence dim (the batch): a per-sample mask such
    as ``[B, 1, 1, L]`` (key padding) applies to every line the other sequence dims fold in.
    """
    first = spec.first_axis
    lead = q.shape[:first]
    others = math.prod(q.shape[first + i] for i, n in enumerate(spec.names) if n not in over)
    if mask.dim() > first + 3:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} has too many dims: it must broadcast "
            f"to [*batch {tuple(lead)}, heads, Lq, Lk]"
        )
    m = mask.reshape((1,) * (first + 3 - mask.dim()) + tuple(mask.shape))
    m = m.expand(*lead, *m.shape[first:])  # batch axes broadcast to the real batch
    m = m.reshape(math.prod(lead), 1, *m.shape[first:])
    m = m.expand(-1, others, *m.shape[2:])
    return m.reshape(-1, *m.shape[2:])


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: SeqSpec,
    over: str | tuple[str, ...],
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention along the whole local dims ``over`` of ``[B, *seq, H, D]`` tensors.

    Several ``over`` dims are attended jointly (flattened in the given order); the other
    sequence dims (and the batch) fold into the attention batch. ``mask`` is boolean (True =
    attend) and broadcastable to ``[*batch, H, Lq, Lk]`` over the attended sequence.
    """
    over = (over,) if isinstance(over, str) else tuple(over)
    qf, moved = fold_attention_dims(q, spec, over)
    kf, _ = fold_attention_dims(k, spec, over)
    vf, _ = fold_attention_dims(v, spec, over)
    folded_mask = None if mask is None else fold_mask(mask, q, spec, over)
    out = attend(qf, kf, vf, mask=folded_mask, causal=causal, scale=scale)
    return unfold_attention_dims(out, moved, spec, over)

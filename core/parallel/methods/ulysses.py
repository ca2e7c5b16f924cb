"""DeepSpeed-Ulysses sequence-parallel attention, exact for uneven sequences and heads.

Each rank holds a contiguous slice of the sequence with every head. All-to-alls
(:func:`dspzoo.core.parallel.comm.switch`) turn q, k and v into "whole sequence, a slice of the heads";
attention is then purely local (ordinary aligned causal masking, since the whole sequence is
present), and one more all-to-all turns the output back into "sequence slice, every head".

Fused exchange: tensors that share a head split travel in one all-to-all, concatenated along
the last axis — ``[q|k|v]`` (``[B, seq_r, H, 3·D]``) when k and v have (or are expanded to) the
query heads, else q alone and ``[k|v]`` together. That is 2 all-to-alls forward (3 for
KV-aligned GQA) instead of 4, with the same bytes; the backward mirrors them.

Splits (``N`` ranks, global length ``L``, ``H`` query heads, ``Hkv`` key/value heads):

* sequence: ``seq_lengths``, any contiguous split (e.g. ``[5, 1, 2]``, or the runtime's
  flattening of several attended dims): the switches take it as their source partition (to
  heads) and destination partition (back), so exactly the real rows travel, no padding.
* heads: the balanced ``shard_sizes(H, N)`` split; with ``H < N`` some ranks get no head and
  run no kernel (their output is an empty tensor that still carries the autograd edges, so every
  rank issues the same backward collectives).
* GQA/MQA: when every rank's query heads are exactly the query heads of its own balanced slice
  of the KV heads (``shard_sizes(H, N) == g · shard_sizes(Hkv, N)`` with ``g = H / Hkv``, e.g.
  ``Hkv % N == 0``), k and v are switched with their own ``Hkv`` split and expanded to the
  rank's query heads locally. Otherwise k and v are first expanded to ``H`` heads
  (``repeat_interleave``, whose backward sums the group's gradients) and switched like q.

Bytes sent per rank (forward; the backward's reverse switches send what the forward received,
the same amount when ``N`` divides ``L`` and ``H``), with ``E = B·(L/N)·H·D·itemsize`` the bytes
of this rank's local q:

* ``Hkv == H``, or k/v expanded: ``4·E·(N−1)/N`` (``[q|k|v]``: 3·E, the output: E). Expanding
  costs k and v ``H/Hkv`` times their own size: the price of head splits that cut KV groups
  (e.g. MQA, or ``H = 4, Hkv = 2`` at ``N = 3``).
* KV-aligned GQA: ``(2·E + 2·E·Hkv/H)·(N−1)/N``.
* uneven: to each rank ``d ≠ r`` the input switch carries ``seq_lengths[r]·heads[d]·B·D``
  elements per tensor (``heads`` the balanced split of the tensor's head count) and the output
  switch ``heads_q[r]·seq_lengths[d]·B·D``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...layers.attention import attend
from ..comm import group_rank, group_size
from ..comm.agreement import Signature, agree, trusted_calls
from ..comm.exchange import switch
from ..layout import shard_sizes
from ..trace import comm_region


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lengths: list[int],
    n: int,
    r: int,
    what: str,
) -> None:
    """Raise a clear ``ValueError`` if q, k, v and ``seq_lengths`` break the method convention.

    Convention: q ``[B, seq_lengths[r], H, D]``, k and v ``[B, seq_lengths[r], Hkv, D]`` with
    ``Hkv`` dividing ``H`` and ``len(seq_lengths)`` equal to the group size. The check is
    local; :func:`agree_attention_args` runs it on every rank together.
    """
    if len(seq_lengths) != n:
        raise ValueError(
            f"{what}: seq_lengths has {len(seq_lengths)} entries {list(seq_lengths)} but the "
            f"group has {n} ranks"
        )
    if any(int(s) < 0 for s in seq_lengths):
        raise ValueError(f"{what}: negative entry in seq_lengths {list(seq_lengths)}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{what}: q, k, v must be [B, L_local, heads, D]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim"
        )
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{what}: {kv_heads} key/value heads must divide the {heads} query heads (GQA/MQA)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] != seq_lengths[r]:
            raise ValueError(
                f"{what}: rank {r} holds {t.shape[1]} tokens of {name} (shape {tuple(t.shape)}) "
                f"but seq_lengths {list(seq_lengths)} gives it {seq_lengths[r]}"
            )


def agree_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lengths: list[int],
    group: Any,
    what: str,
    causal: bool,
    scale: float | None,
    more_checks: Callable[[], None] | None = None,
    more_args: Mapping[str, int] | None = None,
) -> None:
    """:func:`check_attention_args` on every rank plus a cross-rank agreement (one tiny all-gather).

    Raises the same error on every rank of ``group`` if any rank's own check fails or the ranks
    disagree on ``seq_lengths``, ``causal``, ``scale``, or q/k/v's dtype, device, batch, heads or
    head dim. ``more_checks`` (raising ``ValueError``) adds a method's own local checks;
    ``more_args`` names a method's own integer arguments every rank must pass alike.
    Afterwards the method's inner collectives cannot disagree and skip their own.
    """
    n, r = group_size(group), group_rank(group)
    sig = Signature(what).sizes("seq_lengths", seq_lengths).arg("causal", int(causal))
    sig.number("scale", scale)
    for name, value in (more_args or {}).items():
        sig.arg(name, int(value))
    for name, t in (("q", q), ("k", k), ("v", v)):
        sig.tensor(name, t, sharded=(1,) if t.dim() > 1 else ())
    try:
        check_attention_args(q, k, v, seq_lengths, n, r, what)
        if more_checks is not None:
            more_checks()
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    agree(sig, group, q.device)


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, L, Hkv, D]`` → ``[B, L, Hkv·groups, D]``: query head ``h`` reads KV head ``h // groups``."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def scaled(q: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``q`` pre-multiplied so that the kernel's default ``1/sqrt(D)`` becomes ``scale``."""
    if scale is None:
        return q
    factor = scale * q.shape[-1] ** 0.5
    return q if factor == 1.0 else q * factor


def _local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> torch.Tensor:
    """Attention over the whole sequence for this rank's heads (possibly none)."""
    if q.shape[2] == 0 or q.shape[1] == 0:
        # No kernel for empty tensors (flash-attn rejects them). The result still depends on
        # q, k and v so that the backward reaches their switches on this rank as on the others.
        return q + 0 * (k.sum() + v.sum())
    k = expand_kv(k, q.shape[2] // k.shape[2])
    v = expand_kv(v, q.shape[2] // v.shape[2])
    return attend(scaled(q, scale), k, v, causal=causal)


class _SeqLayout:
    """How this rank's sequence slice reaches and leaves the switch.

    Any contiguous split works without padding: the switches take the per-rank sequence
    lengths as their source (to heads) and destination (back) partitions.
    """

    def __init__(self, seq_lengths: list[int], n: int, r: int, device: torch.device) -> None:
        self.lengths = [int(s) for s in seq_lengths]
        self.total, self.r = sum(self.lengths), r

    def to_heads(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """``[B, seq_r, heads, D]`` → ``[B, L, heads_r, D]``."""
        with trusted_calls(group):  # agreed at the method's entry
            return switch(x, 1, 2, group, src_sizes=self.lengths)

    def to_sequence(self, y: torch.Tensor, heads: int, group: Any) -> torch.Tensor:
        """``[B, L, heads_r, D]`` → ``[B, seq_r, heads, D]`` (the inverse of :meth:`to_heads`)."""
        with trusted_calls(group):
            return switch(y, 2, 1, group, src_length=heads, dst_sizes=self.lengths)


def kv_heads_aligned(heads: int, kv_heads: int, n: int) -> bool:
    """Whether each rank's balanced query heads are exactly the groups of its balanced KV heads."""
    g = heads // kv_heads
    return shard_sizes(heads, n) == [g * s for s in shard_sizes(kv_heads, n)]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    seq_lengths: list[int],
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses attention over a sequence sharded contiguously on ``group``.

    Args:
        q: this rank's queries ``[B, seq_lengths[r], H, D]``.
        k, v: this rank's keys and values ``[B, seq_lengths[r], Hkv, D]``; ``Hkv`` divides ``H``.
        group: the SP process group (``None``: one process).
        seq_lengths: tokens held by each rank, in rank order (rank ``r`` starts at
            ``sum(seq_lengths[:r])``); zeros allowed.
        causal: causal masking by global position.
        scale: softmax scale (default ``1/sqrt(D)``); applied by pre-scaling the queries.

    Returns:
        this rank's output ``[B, seq_lengths[r], H, D]``. Every rank must backpropagate
        through its output (an empty one included): the backward issues collectives.

    Forward: one tiny all-gather agreeing on the arguments (a bad input on any rank raises the
    same error on every rank), one all-to-all of ``[q|k|v]`` (or q and ``[k|v]`` for
    KV-aligned GQA) and one of the output; the backward runs the reverse switches. See the module docstring for the splits
    and the bytes.
    """
    n, r = group_size(group), group_rank(group)
    agree_attention_args(q, k, v, seq_lengths, group, "ulysses_attention", causal, scale)
    if n == 1:
        return _local_attention(q, k, v, causal, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    layout = _SeqLayout(seq_lengths, n, r, q.device)
    d = q.shape[3]
    with comm_region("ulysses"):
        if kv_heads_aligned(heads, kv_heads, n) and kv_heads != heads:
            # KV-aligned GQA: q on its own, [k|v] with the KV heads' split
            q_h = layout.to_heads(q, group)
            kv_h = layout.to_heads(torch.cat([k, v], dim=-1), group)
            k_h, v_h = kv_h[..., :d], kv_h[..., d:]
        else:
            # one head split for all three: a single switch of [q|k|v]
            if kv_heads != heads:
                k, v = expand_kv(k, heads // kv_heads), expand_kv(v, heads // kv_heads)
            qkv_h = layout.to_heads(torch.cat([q, k, v], dim=-1), group)
            q_h, k_h, v_h = qkv_h[..., :d], qkv_h[..., d : 2 * d], qkv_h[..., 2 * d :]
        out = _local_attention(q_h, k_h, v_h, causal, scale)
        return layout.to_sequence(out, heads, group)

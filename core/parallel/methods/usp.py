"""USP (unified sequence parallelism): Ulysses all-to-all inside a group, ring attention across.

Rank layout: the SP group of ``R · U`` ranks is a ``R × U`` grid with the Ulysses dim
innermost, ``sp_rank = ring_rank · U + ulysses_rank``. ``ulysses_group`` holds the ``U`` ranks
of one ring slot (consecutive SP ranks), ``ring_group`` the ``R`` ranks with the same Ulysses
rank (stride ``U``). Every rank must belong to exactly one of each.

Sequence layout: the global sequence is first laid out over the ring ranks as in
:func:`~dspzoo.core.parallel.methods.ring.ring_attention` (``seq_lengths[j]`` tokens on ring slot ``j``,
``"contiguous"`` or ``"zigzag"``), and ring slot ``j``'s segment is then split balanced and
contiguous over its ``U`` Ulysses ranks (``shard_sizes(seq_lengths[j], U)``). So SP rank
``(j, u)`` holds the global positions :func:`usp_positions` returns; the causal mask uses them.
For the contiguous layout with ``seq_lengths = shard_sizes(L, R)`` this is the plain contiguous
order of the ``R · U`` shards (their sizes may differ from ``shard_sizes(L, R · U)``).

Steps: :func:`~dspzoo.core.parallel.comm.switch` ``q, k, v`` from sequence-sharded to head-sharded
inside ``ulysses_group`` (each rank then holds its ring slot's whole segment for ``H / U``
heads), ring attention over ``ring_group``, and the inverse switch of the output. With GQA, when
``U`` does not divide both ``H`` and ``Hkv``, keys and values are first repeated to ``H`` heads
so that each rank's query heads find their key/value heads locally.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.agreement import Signature, agree, trusted_calls
from ..comm.exchange import switch
from ..comm.group import group_rank, group_size
from ..layout import shard_offset, shard_sizes
from .ring import ring_attention_agreed, ring_positions, ring_signature

__all__ = ["usp_attention", "usp_positions"]


def usp_positions(
    seq_lengths: list[int],
    ring_rank: int,
    ulysses_size: int,
    ulysses_rank: int,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Global positions (int64) held by SP rank ``(ring_rank, ulysses_rank)`` (module doc)."""
    segment = ring_positions(seq_lengths, ring_rank, layout)
    length = seq_lengths[ring_rank]
    start = shard_offset(length, ulysses_size, ulysses_rank)
    return segment[start : start + shard_sizes(length, ulysses_size)[ulysses_rank]]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: Any,
    ring_group: Any,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None = None,
    layout: str = "contiguous",
    ulysses_lengths: list[int] | None = None,
) -> torch.Tensor:
    """Exact attention with Ulysses inside ``ulysses_group`` and ring across ``ring_group``.

    ``ulysses_lengths`` (tokens of each Ulysses rank of this ring slot) replaces the balanced
    split of the segment, for contiguous layouts that are not balanced within a segment (the
    runtime's flattening of several attended dims). Causal masking assumes the balanced split.

    ``q [Bf, l, H, D]``, ``k``/``v [Bf, l, Hkv, D(v)]``, where ``l`` is this rank's share
    ``shard_sizes(seq_lengths[j], U)[u]`` of its ring slot's segment → ``[Bf, l, H, Dv]``.
    ``seq_lengths`` has one entry per *ring* rank. Autograd-correct (all pieces are).
    """
    u_size = group_size(ulysses_group)
    seq_lengths = [int(s) for s in seq_lengths]
    if ulysses_lengths is not None:
        ulysses_lengths = [int(s) for s in ulysses_lengths]
    split = _agree(
        q, k, v, ulysses_group, ring_group, seq_lengths, ulysses_lengths, causal, scale, layout
    )
    heads, kv_heads = q.shape[2], k.shape[2]
    if u_size > 1 and (heads % u_size or kv_heads % u_size):
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    with trusted_calls(ulysses_group):  # agreed above: the inner switches exchange nothing
        qh, kh, vh = (switch(t, 1, 2, ulysses_group, src_sizes=split) for t in (q, k, v))
        positions = [ring_positions(seq_lengths, j, layout) for j in range(len(seq_lengths))]
        out = ring_attention_agreed(qh, kh, vh, ring_group, positions, causal, scale)
        return switch(out, 2, 1, ulysses_group, src_length=heads, dst_sizes=split)


def _agree(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: Any,
    ring_group: Any,
    seq_lengths: list[int],
    ulysses_lengths: list[int] | None,
    causal: bool,
    scale: float | None,
    layout: str,
) -> list[int]:
    """Check the arguments on every SP rank together; the Ulysses split of this ring segment.

    First inside the Ulysses group (this rank's own checks, and every rank's q/k/v and
    arguments), then across the ring carrying that verdict, so that a bad input on any rank of
    the ``R × U`` grid raises the same error on all of them. Two tiny all-gathers.
    """
    u_size, u_rank = group_size(ulysses_group), group_rank(ulysses_group)
    r_size, r_rank = group_size(ring_group), group_rank(ring_group)
    sig = Signature("usp_attention").sizes("seq_lengths", seq_lengths)
    sig.sizes("ulysses_lengths", ulysses_lengths).arg("ring", r_size)
    split: list[int] = []
    try:
        if len(seq_lengths) != r_size:
            raise ValueError(f"{len(seq_lengths)} seq_lengths for a ring of {r_size}")
        segment = seq_lengths[r_rank]
        if ulysses_lengths is not None and (
            len(ulysses_lengths) != u_size or sum(ulysses_lengths) != segment
        ):
            raise ValueError(
                f"ulysses_lengths {ulysses_lengths} must split the ring segment of {segment} "
                f"tokens over the {u_size} Ulysses ranks"
            )
        split = ulysses_lengths or shard_sizes(segment, u_size)
        want = split[u_rank]
        if q.shape[1] != want or k.shape[1] != want or v.shape[1] != want:
            raise ValueError(
                f"Ulysses rank {u_rank} of a ring segment of {segment} tokens should hold "
                f"{want}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    for name, t in (("q", q), ("k", k), ("v", v)):
        sig.tensor(name, t, sharded=(1,) if t.dim() > 1 else ())
    verdict: Exception | None = None
    try:
        agree(sig, ulysses_group, q.device)
    except (ValueError, TypeError) as exc:  # shared with the other ring slots below
        first = r_rank * u_size  # SP rank = ring rank · U + Ulysses rank
        verdict = ValueError(
            f"in the Ulysses group of ring slot {r_rank} (SP ranks {first}…{first + u_size - 1}): "
            f"{exc}"
        )
    # across the ring: the lengths, mask, scale, layout and q/k/v of every ring slot agree
    ring_sig = ring_signature(q, k, v, seq_lengths, causal, scale, layout, "usp_attention")
    ring_sig.error = verdict
    if verdict is None:
        try:  # the ring layout must be valid for these lengths
            for j in range(r_size):
                ring_positions(seq_lengths, j, layout)
        except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
            ring_sig.error = exc
    agree(ring_sig, ring_group, q.device)
    return split

"""Balanced causal LSS on the contiguous layout: the later rank of each pair lends query rows.

Under a causal mask, contiguous LSS is unbalanced: rank ``r`` holds positions ``[o_r, o_r +
L_r)`` and its query at position ``p`` attends ``p + 1`` keys, so the last rank does
``(2N − 1)/N`` of the average work and rank 0 mostly waits. ``lss_zigzag`` balances it by moving
tokens, which rules out what a contiguous shard allows (a DSP switch to another dim, a scan
along the sharded dim). This keeps the layout and moves *work*: after LSS's all-gather every
rank holds every key and value, so any rank can compute any query row exactly. Ranks are paired
``(x, N − 1 − x)``: the later rank of a pair (the *owner*) sends the tail of its query rows, the
ones that see the most keys, to the earlier one (the *helper*), which computes their whole
attention and sends the finished output rows back. Backward mirrors it: the owner sends those
rows' ``dO``, the helper adds their ``dK``/``dV`` into its share of the reduce-scatter and sends
their ``dQ`` back. With equal blocks of ``b`` rows a pair holds ``N·b²`` (query, key) pairs
whatever ``x`` is, so every rank ends with about ``N·b²/2``; a middle rank (odd ``N``) has
``(N/2)·b²`` already.

The split (:func:`lss_offloads`) is a function of the lengths only, the same on every rank:
the tail count ``t`` that makes the owner's and the helper's visible-key counts closest.

Bytes *sent* (``"p2p"``, one record per tensor, :func:`lss_offload_bytes`), for ``t`` rows of
``Bf`` lines and ``H`` heads: forward, the owner's ``q`` rows (``t·Bf·H·D``) and the helper's
finished ``out`` rows (``t·Bf·H·Dv``); backward, the owner's ``dO`` rows and the helper's ``dQ``
rows, all in the input dtype (the rows are finished where they are computed, so no statistics
travel). The helper also saves the lent rows' ``q``, ``out`` and log-sum-exp for backward
(``t`` rows beyond LSS's saved tensors).

Overlap: the gather is in flight while each rank computes its own block, as in LSS.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .registry import CommCount

__all__ = ["LssOffload", "lss_offload_bytes", "lss_offloads", "visible_keys"]


@dataclass(frozen=True)
class LssOffload:
    """Rows ``[row0, row0 + rows)`` of rank ``owner``'s queries (its tail) are computed on rank
    ``helper`` (``helper < owner``)."""

    owner: int
    helper: int
    row0: int
    rows: int


def visible_keys(start: int, stop: int) -> int:
    """Causal (query, key) pairs of the query rows at positions ``[start, stop)``: row ``p``
    sees ``p + 1`` keys."""
    return (stop * (stop + 1) - start * (start + 1)) // 2


def lss_offloads(seq_lengths: list[int]) -> tuple[LssOffload, ...]:
    """The row loans that balance causal LSS over contiguous shards of ``seq_lengths`` (module
    doc): one per pair ``(x, N − 1 − x)`` whose later rank has more visible keys, with the tail
    count that brings the two ranks' counts closest (pairs with nothing to lend are left out).
    Computed once per length split (the cost model asks for it per rank and layer)."""
    return _offloads(tuple(int(s) for s in seq_lengths))


@functools.lru_cache(maxsize=64)
def _offloads(seq_lengths: tuple[int, ...]) -> tuple[LssOffload, ...]:
    n = len(seq_lengths)
    offsets = [sum(seq_lengths[:j]) for j in range(n)]
    loans = []
    for helper in range(n // 2):
        owner = n - 1 - helper
        end = offsets[owner] + seq_lengths[owner]
        surplus = visible_keys(offsets[owner], end) - visible_keys(
            offsets[helper], offsets[helper] + seq_lengths[helper]
        )
        t = _rows_to_lend(end, seq_lengths[owner], surplus)
        if t > 0:
            loans.append(LssOffload(owner, helper, seq_lengths[owner] - t, t))
    return tuple(loans)


def _rows_to_lend(end: int, length: int, surplus: int) -> int:
    """How many tail rows of a block of ``length`` rows ending at position ``end`` to lend so
    that the owner's ``surplus`` of visible keys over the helper's comes closest to 0 (each lent
    row moves its keys from one side to the other)."""

    def gap(t: int) -> int:
        return surplus - 2 * visible_keys(end - t, end)

    lo, hi = 0, length  # gap falls with t: find the smallest t with gap(t) <= 0
    while lo < hi:
        mid = (lo + hi) // 2
        if gap(mid) <= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo if lo == 0 or abs(gap(lo)) < abs(gap(lo - 1)) else lo - 1


def lss_offload_bytes(
    out: CommCount, seq: list[int], r: int, bf: int, heads: int, head_dim: int, isz: int
) -> None:
    """Add the bytes rank ``r`` sends for the row loans of :func:`lss_offloads` (module doc) to
    ``out``: ``heads`` of ``head_dim`` (q and v alike), items of ``isz`` bytes."""
    for loan in lss_offloads(list(seq)):
        if r in (loan.owner, loan.helper):
            row_bytes = loan.rows * bf * heads * head_dim * isz
            out.add("p2p", "forward", row_bytes)  # q rows out, or finished out rows back
            out.add("p2p", "backward", row_bytes)  # dO rows out, or dQ rows back

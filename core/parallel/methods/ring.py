"""Ring attention: queries stay put, key/value blocks travel around the SP ring.

Each of the ``N`` ranks of ``group`` holds its shard ``q, k, v [Bf, L_r, H(kv), D]`` of one
sequence of global length ``L = sum(seq_lengths)``. In ``N`` steps every rank attends its
queries to every rank's key block: at step ``s`` rank ``r`` holds the block of rank
``(r − s) mod N`` and, before computing on it, starts sending it to ``r + 1`` (so the transfer
overlaps the block's attention). Partial results are merged in fp32 (fp64 for fp64 inputs) with
the log-sum-exp :func:`~dspzoo.core.parallel.methods.blockwise.merge`.

Layouts (which global positions a rank's tokens have; they drive the causal mask):

* ``"contiguous"``: rank ``r`` holds positions ``[o_r, o_r + L_r)`` with
  ``o_r = sum(seq_lengths[:r])``; any lengths, including 0.
* ``"zigzag"``: the sequence is cut into ``2N`` balanced chunks (``shard_sizes(L, 2N)``) and
  rank ``r`` holds chunks ``r`` and ``2N − 1 − r``, concatenated in that order
  (:func:`zigzag_positions`). Under a causal mask every rank then has about the same work.
  ``seq_lengths`` must be :func:`zigzag_lengths`; :func:`zigzag_split` and
  :func:`zigzag_gather` move activations into and out of this layout.

Each block runs through the shared kernel of :mod:`.kernels` (the fused CPU attention with its
log-sum-exp by default, cut into exactly causal pieces; or the einsum ``blockwise`` kernel), so
no score matrix of a whole block is materialised.

Backward (a custom autograd function) saves only ``q, k, v, out, lse``. It runs the ring again:
each block's share of the gradient is recomputed from the final ``out``/``lse``
(FlashAttention-2 style); ``dQ`` accumulates locally while ``dK``/``dV`` accumulators travel with
their K/V block and arrive at the block's owner after ``N`` hops. Memory stays ``O(L / N)`` per
rank. Blocks with no visible key (empty, or entirely in the causal future) are skipped.

Traced transfers (``"p2p"``, bytes *sent* by this rank, one record per tensor): forward, the K
and V blocks of steps ``0 … N−2`` (the blocks of ranks ``r, r−1, …, r−N+2``); backward, the
same K/V sends plus the ``dK``/``dV`` accumulators of steps ``0 … N−1`` in the statistics dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..comm.agreement import Signature, agree, trusted_calls
from ..comm.group import group_rank, group_size, norm_dim
from ..comm.p2p import RingTransfer
from ..comm.replicate import agree_replicated, gather
from ..layout import shard_sizes
from ..trace import current_region
from .blockwise import stats_dtype
from .kernels import BlockwiseKernel, FusedKernel, LseAccumulator, select_kernel, visible_any

__all__ = [
    "ring_attention",
    "ring_positions",
    "zigzag_gather",
    "zigzag_lengths",
    "zigzag_positions",
    "zigzag_split",
]

LAYOUTS = ("contiguous", "zigzag")


def zigzag_lengths(length: int, n: int) -> list[int]:
    """Tokens per rank in the zigzag layout of a sequence of ``length`` over ``n`` ranks."""
    chunks = shard_sizes(length, 2 * n)
    return [chunks[r] + chunks[2 * n - 1 - r] for r in range(n)]


def zigzag_positions(length: int, n: int, rank: int) -> torch.Tensor:
    """Global positions (int64) held by ``rank``: chunk ``rank`` then chunk ``2n − 1 − rank``."""
    chunks = shard_sizes(length, 2 * n)
    starts = [sum(chunks[:i]) for i in range(2 * n)]
    a, b = rank, 2 * n - 1 - rank
    return torch.cat(
        [
            torch.arange(starts[a], starts[a] + chunks[a]),
            torch.arange(starts[b], starts[b] + chunks[b]),
        ]
    )


def ring_positions(seq_lengths: list[int], rank: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions (int64) of ``rank``'s tokens under ``layout`` (see the module doc)."""
    if layout == "contiguous":
        start = sum(seq_lengths[:rank])
        return torch.arange(start, start + seq_lengths[rank])
    if layout == "zigzag":
        n, length = len(seq_lengths), sum(seq_lengths)
        if list(seq_lengths) != zigzag_lengths(length, n):
            raise ValueError(
                f"zigzag layout of {length} tokens over {n} ranks has lengths "
                f"{zigzag_lengths(length, n)}, got seq_lengths {list(seq_lengths)}"
            )
        return zigzag_positions(length, n, rank)
    raise ValueError(f"unknown ring layout {layout!r}; expected one of {LAYOUTS}")


def zigzag_split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Replicated → zigzag shard of axis ``dim`` (no communication either way).

    Like :func:`dspzoo.core.parallel.comm.split`: backward puts this rank's gradient rows in place in
    a zero tensor of the full shape. The output is a fresh tensor. The ranks agree on ``dim``
    and ``x``'s shape, dtype and device first (every rank raises if one differs).
    """
    if group_size(group) > 1:
        dim = agree_replicated(x, dim, group, "zigzag_split")
    dim = dim % x.dim()
    pos = zigzag_positions(x.shape[dim], group_size(group), group_rank(group))
    return x.index_select(dim, pos.to(x.device))


def zigzag_gather(x: torch.Tensor, dim: int, group: Any, length: int) -> torch.Tensor:
    """Zigzag shard of axis ``dim`` → the replicated sequence of ``length`` rows.

    Like :func:`dspzoo.core.parallel.comm.gather` (whose contract it inherits: what follows is computed
    identically on every rank; backward keeps this rank's rows × N). Shards are padded to the
    longest zigzag shard for one all-gather, then reordered.
    """
    n = group_size(group)
    if n == 1:
        return x
    sig = Signature("zigzag_gather")
    try:
        dim = norm_dim(x, dim, "zigzag_gather")
        sig.arg("dim", dim).arg("length", length).tensor("x", x, sharded=(dim,))
        sig.local(f"rows of dim {dim}", x.shape[dim])
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    agreed = agree(sig, group, x.device)
    sizes = zigzag_lengths(length, n)
    agreed.check_rows(f"rows of dim {dim}", sizes, f"the zigzag layout of {length} over {n} ranks")
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    with trusted_calls(group):  # agreed above
        full = gather(x, dim, group, n * longest)
    order = torch.empty(length, dtype=torch.long)
    for j in range(n):
        order[zigzag_positions(length, n, j)] = torch.arange(sizes[j]) + j * longest
    return full.index_select(dim, order.to(full.device))


def ring_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None,
    layout: str,
    primitive: str,
) -> Signature:
    """What every rank of a ring must pass equally: lengths, mask, scale, layout, q/k/v up to L_r."""
    sig = Signature(primitive).sizes("seq_lengths", seq_lengths).arg("causal", int(causal))
    sig.number("scale", scale).arg("layout", LAYOUTS.index(layout) if layout in LAYOUTS else -1)
    for name, t in (("q", q), ("k", k), ("v", v)):
        sig.tensor(name, t, sharded=(1,) if t.dim() > 1 else ())
    return sig


def check_ring_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lengths: list[int],
    n: int,
    r: int,
    layout: str,
) -> list[torch.Tensor]:
    """This rank's own checks; the global positions of every rank's tokens."""
    if len(seq_lengths) != n:
        raise ValueError(f"{len(seq_lengths)} seq_lengths {seq_lengths} for a group of {n}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [Bf, L_r, heads, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] != seq_lengths[r] or k.shape[1] != seq_lengths[r] or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"rank {r} should hold {seq_lengths[r]} tokens (seq_lengths {seq_lengths}); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return [ring_positions(seq_lengths, j, layout) for j in range(n)]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None = None,
    layout: str = "contiguous",
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries on the whole sequence, sharded over ``group``.

    ``q [Bf, L_r, H, D]``, ``k``/``v [Bf, L_r, Hkv, D(v)]`` with ``L_r = seq_lengths[r]`` →
    ``out [Bf, L_r, H, Dv]`` in q's dtype. ``Hkv`` divides ``H`` (GQA). ``layout`` gives the
    global positions of each rank's tokens (module doc); the causal mask uses them. ``kernel``
    picks the block kernel (:func:`~dspzoo.core.parallel.methods.kernels.select_kernel`:
    ``"fused"``, ``"blockwise"``, ``None`` for ``$DSPZOO_ATTENTION_KERNEL``). Once differentiable. The ranks agree on the arguments first (one tiny all-gather): a wrong
    shard, dtype, head count or ``seq_lengths`` on any rank raises the same error on every rank.
    """
    positions = agree_ring_args(
        q, k, v, group, seq_lengths, causal, scale, layout, "ring_attention"
    )
    return ring_attention_agreed(q, k, v, group, positions, causal, scale, kernel)


def agree_ring_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None,
    layout: str,
    primitive: str,
) -> list[torch.Tensor]:
    """Check a ring call's arguments on this rank and agree on them with every rank (one tiny
    all-gather; a problem on any rank raises the same error on all); the global positions of
    every rank's tokens."""
    n, r = group_size(group), group_rank(group)
    seq_lengths = [int(s) for s in seq_lengths]
    sig = ring_signature(q, k, v, seq_lengths, causal, scale, layout, primitive)
    positions: list[torch.Tensor] = []
    try:
        positions = check_ring_args(q, k, v, seq_lengths, n, r, layout)
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    agree(sig, group, q.device)
    return positions


def ring_attention_agreed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    positions: list[torch.Tensor],
    causal: bool,
    scale: float | None,
    kernel: str | None = None,
) -> torch.Tensor:
    """:func:`ring_attention` after its checks: ``positions`` of every rank's tokens."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = select_kernel(q, kernel)
    return _RingAttention.apply(
        q, k, v, group, positions, bool(causal), scale, current_region(), impl
    )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Any,
        positions: list[torch.Tensor],
        causal: bool,
        scale: float,
        region: str,
        impl: BlockwiseKernel | FusedKernel,
    ) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        bf, lq, h, _ = q.shape
        acc = LseAccumulator(bf, lq, h, v.shape[-1], q.dtype, q.device)
        kb, vb = k.detach(), v.detach()
        for s in range(n):
            src = (r - s) % n
            transfer = None
            if s < n - 1:  # start passing this block on before computing with it
                nxt = len(positions[(src - 1) % n])
                transfer = RingTransfer(
                    [kb, vb],
                    group,
                    [(bf, nxt, *k.shape[2:]), (bf, nxt, *v.shape[2:])],
                    phase="forward",
                    region=region,
                )
            if visible_any(causal, positions[r], positions[src]):
                impl.forward(acc, q, kb, vb, positions[r], positions[src], causal, scale)
            if transfer is not None:
                kb, vb = transfer.wait()
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.group, ctx.positions, ctx.causal, ctx.scale, ctx.region, ctx.impl = (
            group,
            positions,
            causal,
            scale,
            region,
            impl,
        )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, positions, causal, scale, region = (
            ctx.group,
            ctx.positions,
            ctx.causal,
            ctx.scale,
            ctx.region,
        )
        n, r = group_size(group), group_rank(group)
        bf = q.shape[0]
        dt = stats_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        kb, vb = k, v
        grads: RingTransfer | None = None  # the dK/dV accumulators in flight
        for s in range(n):
            src = (r - s) % n
            nxt = len(positions[(src - 1) % n])
            kv = None
            if s < n - 1:
                kv = RingTransfer(
                    [kb, vb],
                    group,
                    [(bf, nxt, *k.shape[2:]), (bf, nxt, *v.shape[2:])],
                    phase="backward",
                    region=region,
                )
            part = None  # this block's dK/dV, computed while the accumulators travel
            if visible_any(causal, positions[r], positions[src]):
                part = (
                    torch.zeros(kb.shape, dtype=dt, device=q.device),
                    torch.zeros(vb.shape, dtype=dt, device=q.device),
                )
                ctx.impl.backward(
                    (dq, *part),
                    q,
                    kb,
                    vb,
                    out,
                    lse,
                    dout,
                    positions[r],
                    positions[src],
                    causal,
                    scale,
                )
            if grads is None:
                dk = torch.zeros(kb.shape, dtype=dt, device=q.device)
                dv = torch.zeros(vb.shape, dtype=dt, device=q.device)
            else:
                dk, dv = grads.wait()
            if part is not None:
                dk += part[0]
                dv += part[1]
            # hand the accumulators on with their block; after N hops they reach the owner
            grads = RingTransfer(
                [dk, dv],
                group,
                [(bf, nxt, *k.shape[2:]), (bf, nxt, *v.shape[2:])],
                phase="backward",
                region=region,
                tag=2,
            )
            if kv is not None:
                kb, vb = kv.wait()
        assert grads is not None
        dk, dv = grads.wait()
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 6

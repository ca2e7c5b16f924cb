"""Ring attention with balanced causal work on the contiguous layout (``ring_balanced``).

Under a causal mask, contiguous ring attention is unbalanced: rank ``r`` holds positions
``[o_r, o_r + L_r)``, so its queries see the key blocks of ranks ``0 … r`` and the last rank
does ``(2N − 1)/N`` of the average work while rank 0 mostly waits. A zigzag layout balances it
by moving tokens (``ring_zigzag``), which breaks what a contiguous shard allows: a DSP switch to
another dim, a scan along the sharded dim. This method keeps the contiguous layout and moves
*work* instead (the load-balanced schedule of DistFlashAttn, Li et al. 2023): every (query
block, earlier key block) pair is computed once, either where the queries live (the keys
travel) or where the keys live (the queries travel and the partial result ``(out, lse)`` comes
back), so that every rank computes the same number of pairs.

The schedule (:func:`balanced_schedule`) has ``⌊N/2⌋`` steps. At step ``d`` rank ``x`` takes
the pair of blocks ``x`` and ``x − d (mod N)``: for ``x ≥ d`` its own queries on block
``x − d``'s keys, for ``x < d`` the queries of block ``x − d + N`` on its own keys. With ``N``
even, step ``N/2`` meets each pair from both of its ranks, and each takes half of the query
rows. So each rank computes ``(N − 1)/2`` pairs plus its own diagonal block (every rank the
same), in ``⌊N/2⌋`` steps instead of ring's ``N − 1``. At every step each rank sends one
message to ``x + d`` and receives one from ``x − d``: K and V, or the query rows; the partial
results of the queries that travelled come back on the reverse shift. The next step's message
is in flight while the current pair is computed.

Backward recomputes each pair's share where the forward computed it (FlashAttention-2 style,
from the final ``out``/``lse``): a pair computed by the queries' owner receives K and V again
and sends ``dK``/``dV`` back; a pair computed by the keys' owner receives the query rows with
their ``dO``, ``out`` and ``lse`` and sends ``dQ`` back. Saved for backward: ``q, k, v, out,
lse`` (O(L/N) per rank, as ring).

Traced transfers (``"p2p"``, bytes *sent* by this rank, one record per tensor, at each step
``d`` with this rank's block in the pair computed by rank ``x + d``): forward, K and V when that
pair is computed by the queries' owner, else the query rows; and, for a pair this rank computed
for another's queries, its ``out`` and ``lse`` rows in the statistics dtype. Backward: K and V,
or the query rows with ``dO``, ``out`` (the input dtype) and ``lse`` (statistics dtype); and
``dK``/``dV`` or ``dQ`` partials in the statistics dtype (:func:`balanced_ring_bytes`).

Non-causal attention is balanced already (every rank attends to every block): it runs the
plain ring (:func:`~dspzoo.core.parallel.methods.ring.ring_attention_agreed`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from ..comm.group import group_rank, group_size
from ..comm.p2p import PeerTransfer
from ..trace import current_region
from .blockwise import stats_dtype
from .kernels import BlockwiseKernel, FusedKernel, LseAccumulator, select_kernel
from .ring import agree_ring_args, ring_attention_agreed

if TYPE_CHECKING:
    from .registry import CommCount

__all__ = [
    "BalancedTask",
    "balanced_ring_attention",
    "balanced_ring_bytes",
    "balanced_schedule",
]

# p2p tags of step d: 8·d + i for tensor i of the step's message, 8·d + 4 + i for the partial
# results coming back (at most 4 tensors each: q, dO, out, lse)
_TAGS_PER_STEP, _MAX_TENSORS = 8, 4


@dataclass(frozen=True)
class BalancedTask:
    """Rows ``[row0, row1)`` of rank ``query``'s queries on rank ``key``'s block (``key <
    query``: all of it visible), computed on rank ``at`` (``query`` or ``key``)."""

    query: int
    row0: int
    row1: int
    key: int
    at: int

    @property
    def keys_travel(self) -> bool:
        """The queries' owner computes it: K and V are sent to it (else the queries travel)."""
        return self.at == self.query


def balanced_schedule(seq_lengths: list[int]) -> list[dict[int, BalancedTask]]:
    """The balanced schedule of a contiguous causal ring over ``seq_lengths``: per step
    ``d = 1 … ⌊N/2⌋``, the task of each rank that has one (``{at: BalancedTask}``; pairs with no
    query row or no key are dropped). Every pair ``(query block, earlier key block)`` appears
    once (split in two halves of its query rows at ``d = N/2``). Built once per length split
    (the cost model asks for it per rank and layer); the result is shared: do not modify it."""
    return _schedule(tuple(int(s) for s in seq_lengths))


@functools.lru_cache(maxsize=64)
def _schedule(seq_lengths: tuple[int, ...]) -> list[dict[int, BalancedTask]]:
    n = len(seq_lengths)
    steps = []
    for d in range(1, n // 2 + 1):
        step = {}
        for x in range(n):
            query, key = (x, x - d) if x >= d else (x - d + n, x)
            row0, row1 = 0, seq_lengths[query]
            if 2 * d == n:  # met from both ranks of the pair: each takes half of the rows
                half = seq_lengths[query] // 2
                row0, row1 = (0, half) if x == query else (half, seq_lengths[query])
            if row1 > row0 and seq_lengths[key] > 0:
                step[x] = BalancedTask(query, row0, row1, key, x)
        steps.append(step)
    return steps


def _outgoing(step: dict[int, BalancedTask], d: int, n: int, r: int) -> BalancedTask | None:
    """The task of step ``d`` that needs this rank's block (computed by rank ``r + d``)."""
    task = step.get((r + d) % n)
    return task if task is not None and r in (task.query, task.key) and task.at != r else None


def balanced_ring_bytes(
    out: CommCount,
    seq: list[int],
    r: int,
    bf: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    isz: int,
    stat: int,
) -> None:
    """Add the bytes rank ``r`` sends (module doc) to ``out``: ``seq`` tokens per rank, ``bf``
    folded lines, ``heads``/``kv_heads`` of ``head_dim``, items of ``isz`` bytes, statistics
    of ``stat`` bytes."""
    d = head_dim
    n = len(seq)
    for step_index, step in enumerate(balanced_schedule(list(seq))):
        shift = step_index + 1
        task = _outgoing(step, shift, n, r)
        if task is not None:
            if task.keys_travel:
                kv = seq[r] * bf * kv_heads * d * isz
                out.add("p2p", "forward", 2 * kv, count=2)
                out.add("p2p", "backward", 2 * kv, count=2)
            else:
                rows = (task.row1 - task.row0) * bf * heads
                out.add("p2p", "forward", rows * d * isz)
                out.add("p2p", "backward", 3 * rows * d * isz + rows * stat, count=4)
        mine = step.get(r)
        if mine is not None and not mine.keys_travel:  # partial results go back to the queries
            rows = (mine.row1 - mine.row0) * bf * heads
            out.add("p2p", "forward", rows * d * stat + rows * stat, count=2)
            out.add("p2p", "backward", rows * d * stat)
        elif mine is not None:  # dK, dV go back to the keys' owner
            out.add("p2p", "backward", 2 * seq[mine.key] * bf * kv_heads * d * stat, count=2)


def balanced_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    seq_lengths: list[int],
    causal: bool,
    scale: float | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries on the whole sequence, contiguous shards over
    ``group``, causal work balanced (module doc).

    ``q [Bf, L_r, H, D]``, ``k``/``v [Bf, L_r, Hkv, D(v)]`` with ``L_r = seq_lengths[r]``
    (rank ``r`` holds positions ``[sum(seq_lengths[:r]), …)``; any lengths, 0 included) →
    ``out [Bf, L_r, H, Dv]`` in q's dtype. ``kernel`` as for
    :func:`~dspzoo.core.parallel.methods.ring.ring_attention`. Once differentiable. The ranks
    agree on the arguments first: a wrong shard or ``seq_lengths`` on any rank raises the same
    error on every rank.
    """
    seq_lengths = [int(s) for s in seq_lengths]
    positions = agree_ring_args(
        q, k, v, group, seq_lengths, causal, scale, "contiguous", "ring_balanced"
    )
    if not causal or group_size(group) == 1:
        return ring_attention_agreed(q, k, v, group, positions, causal, scale, kernel)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    impl = select_kernel(q, kernel)
    return _BalancedRing.apply(
        q, k, v, group, positions, seq_lengths, scale, current_region(), impl
    )


def _start(
    sends: list[tuple[int, torch.Tensor]],
    receives: list[tuple[int, tuple[int, ...], torch.dtype]],
    tag: int,
    where: tuple[Any, torch.device, str, str],
) -> PeerTransfer:
    """One message of a step (``tag``: the step's, or its returns'), on ``where = (group,
    device, phase, region)``."""
    assert len(sends) <= _MAX_TENSORS and len(receives) <= _MAX_TENSORS  # the tag budget
    group, device, phase, region = where
    return PeerTransfer(sends, receives, group, device, phase, region, tag=tag)


def _start_step(
    steps: list[dict[int, BalancedTask]],
    d: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    rows: list[tuple[torch.Tensor, int]],
    seq_lengths: list[int],
    where: tuple[Any, torch.device, str, str],
) -> PeerTransfer:
    """Start step ``d``'s message (forward and backward alike): this rank's block goes to the
    rank computing the pair it is in, as ``kv`` (its K and V, when the keys travel) or as the
    pair's query rows of each ``(tensor, row axis)`` of ``rows``; the pair this rank computes
    arrives the same way from the other rank, shaped like this rank's own tensors."""
    group = where[0]
    n, r = group_size(group), group_rank(group)
    step, sends, receives = steps[d - 1], [], []
    out_task = _outgoing(step, d, n, r)
    if out_task is not None and out_task.keys_travel:
        sends = [(out_task.at, t) for t in kv]
    elif out_task is not None:
        count = out_task.row1 - out_task.row0
        sends = [(out_task.at, t.narrow(axis, out_task.row0, count)) for t, axis in rows]
    task = step.get(r)
    if task is not None and task.keys_travel:
        receives = [(task.key, _resized(t, 1, seq_lengths[task.key]), t.dtype) for t in kv]
    elif task is not None:
        count = task.row1 - task.row0
        receives = [(task.query, _resized(t, axis, count), t.dtype) for t, axis in rows]
    return _start(sends, receives, _TAGS_PER_STEP * d, where)


def _resized(t: torch.Tensor, axis: int, length: int) -> tuple[int, ...]:
    """``t``'s shape with ``length`` rows along ``axis``."""
    shape = list(t.shape)
    shape[axis] = length
    return tuple(shape)


class _BalancedRing(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Any,
        positions: list[torch.Tensor],
        seq_lengths: list[int],
        scale: float,
        region: str,
        impl: BlockwiseKernel | FusedKernel,
    ) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        bf, _, h, dv = *q.shape[:3], v.shape[-1]
        steps = balanced_schedule(seq_lengths)
        kd, vd = k.detach(), v.detach()
        where = (group, q.device, "forward", region)

        def start(d: int) -> PeerTransfer:  # K, V or the query rows
            return _start_step(steps, d, (kd, vd), [(q.detach(), 1)], seq_lengths, where)

        acc = LseAccumulator(bf, q.shape[1], h, dv, q.dtype, q.device)
        transfer = start(1) if steps else None
        if q.shape[1]:  # the own diagonal block, while the first message travels
            impl.forward(acc, q, kd, vd, positions[r], positions[r], True, scale)
        pending: tuple[PeerTransfer, BalancedTask | None] | None = None  # last step's returns

        def merge_returns() -> None:
            """Finish the previous step's returns: merge the partial results of this rank's
            queries that travelled (one step late, so they overlap a step's compute and at most
            one step's partials are held)."""
            if pending is not None:
                got, back = pending[0].wait(), pending[1]
                if back is not None:
                    acc.add(back.row0, back.row1, got[0], got[1])

        for d in range(1, len(steps) + 1):
            assert transfer is not None
            got = transfer.wait()
            transfer = start(d + 1) if d < len(steps) else None
            task, sends = steps[d - 1].get(r), []
            if task is not None and task.keys_travel:
                rows = slice(task.row0, task.row1)
                impl.forward(
                    acc.rows(task.row0, task.row1),
                    q[:, rows],
                    got[0],
                    got[1],
                    positions[r][rows],
                    positions[task.key],
                    True,
                    scale,
                )
            elif task is not None:  # another rank's queries on this rank's keys
                part = LseAccumulator(bf, task.row1 - task.row0, h, dv, q.dtype, q.device)
                q_pos = positions[task.query][task.row0 : task.row1]
                impl.forward(part, got[0], kd, vd, q_pos, positions[r], True, scale)
                sends = [(task.query, part.out), (task.query, part.lse)]
            back = _outgoing(steps[d - 1], d, n, r)
            receives = []
            if back is not None and not back.keys_travel:
                n_rows = back.row1 - back.row0
                receives = [
                    (back.at, (bf, n_rows, h, dv), acc.dtype),
                    (back.at, (bf, h, n_rows), acc.dtype),
                ]
            else:
                back = None
            returned = _start(sends, receives, _TAGS_PER_STEP * d + 4, where)
            merge_returns()
            pending = (returned, back)
        merge_returns()
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.group, ctx.positions, ctx.seq_lengths = group, positions, seq_lengths
        ctx.scale, ctx.region, ctx.impl = scale, region, impl
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, positions, seq_lengths = ctx.group, ctx.positions, ctx.seq_lengths
        scale, impl = ctx.scale, ctx.impl
        n, r = group_size(group), group_rank(group)
        bf = q.shape[0]
        dt = stats_dtype(q.dtype)
        dout = dout.contiguous()
        steps = balanced_schedule(seq_lengths)
        where = (group, q.device, "backward", ctx.region)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)

        def start(d: int) -> PeerTransfer:  # K, V or the query rows with dO, out and lse
            rows = [(q, 1), (dout, 1), (out, 1), (lse, 2)]
            return _start_step(steps, d, (k, v), rows, seq_lengths, where)

        transfer = start(1) if steps else None
        if q.shape[1]:
            own = positions[r]
            impl.backward((dq, dk, dv), q, k, v, out, lse, dout, own, own, True, scale)
        pending: tuple[PeerTransfer, BalancedTask | None] | None = None  # last step's returns

        def add_returns() -> None:
            """Finish the previous step's returns: add the gradient shares computed elsewhere
            (one step late, as in forward)."""
            if pending is not None:
                got, back = pending[0].wait(), pending[1]
                if back is not None and back.keys_travel:
                    dk.add_(got[0])
                    dv.add_(got[1])
                elif back is not None:
                    dq[:, back.row0 : back.row1] += got[0]

        for d in range(1, len(steps) + 1):
            assert transfer is not None
            got = transfer.wait()
            transfer = start(d + 1) if d < len(steps) else None
            task, sends = steps[d - 1].get(r), []
            if task is not None and task.keys_travel:
                rows = slice(task.row0, task.row1)
                part_k = torch.zeros(got[0].shape, dtype=dt, device=q.device)
                part_v = torch.zeros(got[1].shape, dtype=dt, device=q.device)
                impl.backward(
                    (dq[:, rows], part_k, part_v),
                    q[:, rows],
                    got[0],
                    got[1],
                    out[:, rows],
                    lse[:, :, rows],
                    dout[:, rows],
                    positions[r][rows],
                    positions[task.key],
                    True,
                    scale,
                )
                sends = [(task.key, part_k), (task.key, part_v)]
            elif task is not None:  # another rank's queries on this rank's keys
                q_in, dout_in, out_in, lse_in = got
                part_q = torch.zeros(q_in.shape, dtype=dt, device=q.device)
                q_pos = positions[task.query][task.row0 : task.row1]
                impl.backward(
                    (part_q, dk, dv),
                    q_in,
                    k,
                    v,
                    out_in,
                    lse_in,
                    dout_in,
                    q_pos,
                    positions[r],
                    True,
                    scale,
                )
                sends = [(task.query, part_q)]
            back = _outgoing(steps[d - 1], d, n, r)
            receives = []
            if back is not None and back.keys_travel:
                receives = [(back.at, tuple(k.shape), dt), (back.at, tuple(v.shape), dt)]
            elif back is not None:
                receives = [(back.at, (bf, back.row1 - back.row0, *q.shape[2:]), dt)]
            returned = _start(sends, receives, _TAGS_PER_STEP * d + 4, where)
            add_returns()
            pending = (returned, back)
        add_returns()
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 6

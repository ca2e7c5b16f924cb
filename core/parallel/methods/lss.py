"""Long-Short-Sequence (LSS) transformer attention: local queries, one fused K/V all-gather.

Each rank keeps its segment of queries (contiguous, or zigzag: see Layouts). Keys and values
of every segment arrive in one collective: this rank's k and v are concatenated along the last
axis into one buffer ``[B, seq_r, Hkv, 2·D]`` and that buffer is all-gathered along the sequence.
That is what "fused communication" means here: **one all-gather of [k|v] instead of two** (one
launch, one synchronisation, the same bytes). Its backward is a reduce-scatter of the [dk|dv]
buffer (each rank's queries produce gradients for every key; the sums go back to the keys'
owners), so the gradients are exact.

Overlap (the kernel path, :class:`_LssAttention`; without lent rows): the all-gather is
started, not waited on; while it is in flight the rank computes its queries on its *own* K/V
block, then on the other ranks' blocks where they sit in the gathered buffer (each block with
its global positions, so no reordering for the zigzag layout). Backward mirrors it: the other blocks' ``dK``/``dV``
first, then the reduce-scatter is started (this rank's own slot zero) and the own block's
gradients are computed while it is in flight, and added to what arrives.

The local queries then attend to all keys with causal masking by global positions (query
``i`` of rank ``r`` at position ``p_r[i]`` sees keys ``j <= p_r[i]``; keys past the rank's last
query are not even read). GQA/MQA never expands the gathered K/V: the buffer has ``Hkv`` heads.

Layouts: ``"contiguous"`` (rank ``r`` holds ``[o_r, o_r + seq_r)``) leaves the causal work
unbalanced — the last rank attends to the whole sequence, the first to its own segment only.
``"zigzag"`` (the ``lss_zigzag`` method; rank ``r`` holds chunks ``r`` and ``2N−1−r`` of
``2N``, as :mod:`.ring`'s zigzag) gives every rank the same number of causal (query, key)
pairs, for the same bytes. ``balanced=True`` on the contiguous layout (the ``lss_balanced``
method) balances the work without moving tokens: the later rank of each pair ``(x, N−1−x)``
lends the tail of its query rows to the earlier one, which computes them on the gathered K/V
and sends the finished rows back (:mod:`.lss_offload`; a few more bytes, point to point).

Memory: the kernel is the shared one of :mod:`.kernels` (used when
:func:`dspzoo.core.parallel.methods.blockwise.chunked_attention` is importable): by default
PyTorch's fused CPU attention with its log-sum-exp, cut into exactly causal pieces, or the
einsum ``blockwise`` kernel on ``chunk`` × ``chunk`` blocks; either way only q, the gathered
blocks (the own K/V is read back from its slot), out and the log-sum-exp are saved for
backward (with lent rows the helper also saves their q, out and log-sum-exp). Without that module the
fallback (:func:`dspzoo.core.parallel.comm.gather_for_local_use`, the rows put in position
order, then ``attend``) folds each KV group's
``g = H / Hkv`` query heads into the query rows (``[B, seq_r·g, Hkv, D]``) and calls
:func:`~dspzoo.core.layers.attention.attend`: once without a mask when not causal, else per
chunk of query rows with an explicit ``[rows, keys]`` boolean mask, each chunk checkpointed so
that backward recomputes one chunk's scores at a time. Either way no ``seq_r × L`` score matrix
exists at once (64K tokens at SP 4: 16K × 64K float32 scores are 4 GiB per head and batch
element).

Bytes sent per rank (``N`` ranks, ``m = max(seq_lengths)``, ``B·Hkv·2·D`` elements per token):
forward all-gather ``(N−1)·m·B·Hkv·2D·itemsize`` — when ``N`` divides ``L`` that is
``(N−1)/N`` of the global K and V bytes, i.e. each rank receives the ``(N−1)/N`` of K and V it
does not hold — and the backward reduce-scatter sends the same. Uneven splits (and the zigzag
layout, ``m = max(zigzag_lengths)``) move the padded chunk (``m`` rows), as every all-gather in
:mod:`dspzoo.core.parallel.comm` does.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ...layers.attention import attend
from ..comm import group_rank, group_size
from ..comm.agreement import guard, trusted_calls
from ..comm.group import all_gather_single, record, reduce_scatter_single
from ..comm.p2p import PeerTransfer
from ..comm.replicate import gather_for_local_use
from ..layout import shard_sizes
from ..trace import comm_region, current_region
from .blockwise import stats_dtype
from .kernels import (
    BlockwiseKernel,
    FusedKernel,
    LseAccumulator,
    add_block,
    add_block_grads,
    select_kernel,
)
from .lss_offload import LssOffload, lss_offloads
from .ring import ring_positions
from .ulysses import agree_attention_args, scaled

DEFAULT_CHUNK = 2048


def _blockwise_kernel() -> Any | None:
    """``dspzoo.core.parallel.methods.blockwise.chunked_attention`` when that module exists, else ``None``."""
    try:
        module = importlib.import_module(f"{__package__}.blockwise")
    except ImportError:
        return None
    return getattr(module, "chunked_attention", None)


def _gather_kv(
    kv: torch.Tensor, seq_lengths: list[int], group: Any, positions: list[torch.Tensor]
) -> torch.Tensor:
    """All-gather ``[B, seq_r, Hkv, 2D]`` along the sequence → ``[B, L, Hkv, 2D]`` in global
    position order (rank ``j``'s rows sit at ``positions[j]``)."""
    n, total = len(seq_lengths), sum(seq_lengths)
    contiguous = all(
        p.numel() == 0 or int(p[0]) == sum(seq_lengths[:j]) for j, p in enumerate(positions)
    )
    if contiguous and seq_lengths == shard_sizes(total, n):
        with trusted_calls(group):  # agreed at the method's entry
            return gather_for_local_use(kv, 1, group, total)
    # any other split or layout: pad every segment to the longest, gather, put rows in order
    rows = max(seq_lengths)
    padded = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, rows - kv.shape[1]))
    with trusted_calls(group):
        full = gather_for_local_use(padded, 1, group, rows * n)
    index = torch.empty(total, dtype=torch.long)
    for j, pos in enumerate(positions):
        index[pos] = torch.arange(j * rows, j * rows + seq_lengths[j])
    return full.index_select(1, index.to(kv.device))


def _fold_groups(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, s, H, D]`` → ``[B, s·g, Hkv, D]``: query head ``h`` reads KV head ``h // g``."""
    b, s, h, d = q.shape
    g = h // kv_heads
    if g == 1:
        return q
    return q.view(b, s, kv_heads, g, d).transpose(2, 3).reshape(b, s * g, kv_heads, d)


def _unfold_groups(out: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_fold_groups`: ``[B, s·g, Hkv, D]`` → ``[B, s, H, D]``."""
    b, sg, kv_heads, d = out.shape
    g = heads // kv_heads
    if g == 1:
        return out
    return out.view(b, sg // g, g, kv_heads, d).transpose(2, 3).reshape(b, sg // g, heads, d)


def _masked_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Causal attention by global positions, ``chunk`` query rows at a time, with ``attend``.

    Each chunk builds its own ``[chunk, keys]`` boolean mask and is checkpointed: autograd keeps
    only q, k, v (views) and the backward recomputes one chunk's scores at a time, whatever
    the kernel behind ``attend`` would have saved.
    """

    def one_chunk(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor):
        mask = k_pos[None, : kc.shape[1]] <= pos[:, None]
        return attend(qc, kc, vc, mask=mask[None, None])

    outs = []
    for start in range(0, q.shape[1], chunk):
        stop = min(start + chunk, q.shape[1])
        pos = q_pos[start:stop]
        keys = int(torch.searchsorted(k_pos, pos.max(), right=True))  # k_pos is increasing
        qc, kc, vc = q[:, start:stop], k[:, :keys], v[:, :keys]
        if torch.is_grad_enabled() and (qc.requires_grad or kc.requires_grad or vc.requires_grad):
            outs.append(checkpoint(one_chunk, qc, kc, vc, pos, use_reentrant=False))
        else:
            outs.append(one_chunk(qc, kc, vc, pos))
    return torch.cat(outs, dim=1)


def lss_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    seq_lengths: list[int],
    causal: bool = False,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    layout: str = "contiguous",
    kernel: str | None = None,
    balanced: bool = False,
) -> torch.Tensor:
    """LSS distributed self-attention over a sequence sharded on ``group``.

    Args:
        q: this rank's queries ``[B, seq_lengths[r], H, D]``.
        k, v: this rank's keys and values ``[B, seq_lengths[r], Hkv, D]``; ``Hkv`` divides ``H``.
        group: the SP process group (``None``: one process).
        seq_lengths: tokens held by each rank, in rank order (any split, zeros allowed; the
            balanced ``shard_sizes`` split needs no padding rows).
        causal: query ``offset_r + i`` sees keys ``j <= offset_r + i``.
        scale: softmax scale (default ``1/sqrt(D)``).
        chunk: rows per block of the blockwise kernel (the fused kernel needs none).
        layout: ``"contiguous"`` (rank ``r`` holds positions ``[o_r, o_r + seq_lengths[r])``) or
            ``"zigzag"`` (chunks ``r`` and ``2N−1−r`` of ``2N``, as ring_zigzag; ``seq_lengths``
            must be :func:`~dspzoo.core.parallel.methods.ring.zigzag_lengths`), which gives
            every rank the same causal work.
        kernel: ``"fused"`` or ``"blockwise"`` (``None``: ``$DSPZOO_ATTENTION_KERNEL``, fused).
        balanced: with ``causal`` on the contiguous layout, balance the causal work by lending
            query rows (:mod:`.lss_offload`); the same outputs and gradients up to rounding
            (the lent rows' dK/dV reach the owner's keys through the reduce-scatter in the
            input dtype, as every other block's do). Ignored when not
            causal (balanced already) and by the fallback without the shared kernel.

    Returns:
        this rank's output ``[B, seq_lengths[r], H, D]``. Every rank must backpropagate
        through its output (an empty one included): the backward reduce-scatters.

    One tiny all-gather agreeing on the arguments (a bad input on any rank raises the same
    error on every rank), one all-gather of the fused ``[k|v]`` buffer forward, one
    reduce-scatter backward, and with ``balanced`` the lent rows point to point (q and out
    forward, dO and dQ backward); see the module docstrings for the bytes.
    """
    n, r = group_size(group), group_rank(group)
    lengths = [int(s) for s in seq_lengths]
    positions: list[torch.Tensor] = []

    def check_local() -> None:
        if chunk < 1:
            raise ValueError(f"lss_attention: chunk must be >= 1, got {chunk}")
        if balanced and layout != "contiguous":
            raise ValueError(
                f"lss_attention: balanced=True balances the contiguous layout; the {layout!r} "
                "layout is balanced by its own cut: pass balanced=False"
            )
        if len(lengths) == n:  # a wrong count is reported by the agreement itself
            positions.extend(ring_positions(lengths, j, layout) for j in range(n))

    agree_attention_args(
        q, k, v, seq_lengths, group, "lss_attention", causal, scale, check_local,
        {"layout": layout == "zigzag", "balanced": bool(balanced)},
    )  # fmt: skip
    if _blockwise_kernel() is not None:  # the shared log-sum-exp kernel; handles GQA itself
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        with comm_region("lss"):
            region = current_region()
        impl = select_kernel(q, kernel)
        loans = lss_offloads(lengths) if balanced and causal and n > 1 else ()
        return _LssAttention.apply(
            q, k, v, group, positions, bool(causal), scale, impl, chunk, region, loans
        )
    # fallback: fold each KV group's query heads into the query rows, then attend
    d, heads, kv_heads = q.shape[3], q.shape[2], k.shape[2]
    q_pos = positions[r]
    kv = torch.cat([k, v], dim=-1)
    with comm_region("lss"):
        kv_all = kv if n == 1 else _gather_kv(kv, lengths, group, positions)
    if causal:  # keys after this rank's last query are never attended to
        kv_all = kv_all[:, : int(q_pos.max()) + 1 if q_pos.numel() else 0]
    if q.shape[1] == 0 or kv_all.shape[1] == 0:
        # nothing to compute; keep the edge to the gathered K/V so the backward collective runs
        return q + 0 * kv_all.sum()
    k_all, v_all = kv_all[..., :d], kv_all[..., d:]
    k_pos = torch.arange(k_all.shape[1])
    g = heads // kv_heads
    q_f = scaled(_fold_groups(q, kv_heads), scale)
    if causal:
        out = _masked_chunks(
            q_f,
            k_all,
            v_all,
            q_pos.to(q.device).repeat_interleave(g),
            k_pos.to(q.device),
            chunk * g,
        )
    else:
        out = attend(q_f, k_all, v_all)
    return _unfold_groups(out, heads)


# -- the kernel path: one autograd function, the collectives overlapped with the own block -----
class _Pending:
    """An asynchronous collective started under :func:`guard`; :meth:`wait` returns ``result``.

    ``start()`` launches it (``async_op=True``); ``send``, its input, is kept alive until then.
    """

    def __init__(
        self,
        start: Any,
        send: torch.Tensor,
        result: torch.Tensor,
        what: str,
        group: Any,
        region: str,
    ) -> None:
        self.result, self._where = result, (what, group, region, result.device)
        self._send: torch.Tensor | None = send
        self._work = None
        if group_size(group) > 1:
            with guard(*self._where):
                self._work = start()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with guard(*self._where):
                self._work.wait()
            self._work = None
        self._send = None
        return self.result


def _start_kv_gather(kv: torch.Tensor, rows: int, group: Any, region: str) -> _Pending:
    """All-gather every rank's ``[B, seq_j, Hkv, 2D]`` padded to ``rows`` → ``[N, B, rows, …]``
    (started, not waited; traced as one forward ``all_gather`` of the padded block)."""
    n = group_size(group)
    send = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, rows - kv.shape[1])).contiguous()
    recv = torch.empty((n, *send.shape), dtype=send.dtype, device=send.device)
    if n == 1:
        recv[0] = send
    record(
        "all_gather", (n - 1) * send.numel() * send.element_size(), group, send, "forward", region
    )
    return _Pending(
        lambda: all_gather_single(recv.flatten(0, 1), send, group=group, async_op=True),
        send,
        recv,
        "all_gather (forward)",
        group,
        region,
    )


def _start_kv_reduce_scatter(
    grads: torch.Tensor, dtype: torch.dtype, group: Any, region: str
) -> _Pending:
    """Reduce-scatter ``[N, B, rows, Hkv, 2D]`` gradients (in ``dtype``, as the forward's K/V)
    → this rank's ``[B, rows, Hkv, 2D]`` (started, not waited; one backward record)."""
    n = group_size(group)
    send = grads.to(dtype).contiguous()
    recv = torch.empty(send.shape[1:], dtype=dtype, device=send.device)
    if n == 1:
        recv.copy_(send[0])
    record("reduce_scatter", (n - 1) * recv.numel() * recv.element_size(), group, recv,
           "backward", region)  # fmt: skip
    return _Pending(
        lambda: reduce_scatter_single(recv, send.flatten(0, 1), group=group, async_op=True),
        send,
        recv,
        "reduce_scatter (backward)",
        group,
        region,
    )


# p2p tags of the row loans
_LOAN_TAG = 64


def _roles(loans: tuple[LssOffload, ...], r: int) -> tuple[LssOffload | None, LssOffload | None]:
    """Rank ``r``'s loans: the one it gives (as the owner) and the one it takes (as the
    helper); a rank is in at most one pair."""
    give = next((loan for loan in loans if loan.owner == r), None)
    take = next((loan for loan in loans if loan.helper == r), None)
    return give, take


def _lend(
    loans: tuple[LssOffload, ...],
    r: int,
    outgoing: torch.Tensor | None,
    incoming: tuple[tuple[int, ...], torch.dtype] | None,
    toward_helper: bool,
    where: tuple[Any, torch.device, str, str],
    tag: int,
) -> PeerTransfer:
    """One message of this rank's loans (every rank constructs it, with nothing to move when it
    has no loan): toward the helper, the owner sends ``outgoing`` rows and the helper receives
    rows shaped ``incoming``; back toward the owner the other way round."""
    group, device, phase, region = where
    give, take = _roles(loans, r)
    sender, receiver = (give, take) if toward_helper else (take, give)
    sends, receives = [], []
    if sender is not None and outgoing is not None:
        sends = [(sender.helper if toward_helper else sender.owner, outgoing)]
    if receiver is not None and incoming is not None:
        peer = receiver.owner if toward_helper else receiver.helper
        receives = [(peer, incoming[0], incoming[1])]
    return PeerTransfer(sends, receives, group, device, phase, region, tag=tag, what="lent rows")


class _LssAttention(torch.autograd.Function):
    """LSS with the shared kernel: this rank's queries on every rank's K/V block.

    Forward starts the all-gather of ``[k|v]`` and computes the own block while it is in
    flight, then the other ranks' blocks as they sit in the gathered buffer (each with its
    global positions: no reordering into position order, whatever the layout). Backward
    computes the other blocks' ``dK``/``dV`` first, starts their reduce-scatter (this rank's
    own slot left zero) and computes the own block's share while it is in flight, then adds
    what arrived. Saves ``q``, the gathered blocks, ``out`` and ``lse``.

    With row loans (``loans``, :mod:`.lss_offload`) the owner computes only its rows before
    ``row0``; the lent rows start first, then the gather, and the
    helper computes the lent rows after its own, on every block, and sends them back
    finished. Backward sends their ``dO`` first; the helper adds their
    ``dK``/``dV`` before its reduce-scatter starts and sends their ``dQ`` back at the end.
    """

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
        impl: BlockwiseKernel | FusedKernel,
        chunk: int,
        region: str,
        loans: tuple[LssOffload, ...],
    ) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        lengths = [p.numel() for p in positions]
        d = k.shape[-1]
        bf, lq, h, _ = q.shape
        dv = v.shape[-1]
        give, take = _roles(loans, r)
        where = (group, q.device, "forward", region)
        keep = give.row0 if give is not None else lq
        lent = None
        if loans:  # the lent query rows, started before the gather on every rank
            incoming = ((bf, take.rows, h, q.shape[-1]), q.dtype) if take is not None else None
            lent = _lend(loans, r, q[:, keep:], incoming, True, where, _LOAN_TAG)
        pending = _start_kv_gather(torch.cat([k, v], dim=-1), max(lengths), group, region)
        got = lent.wait() if lent is not None else None
        acc = LseAccumulator(bf, keep, h, dv, q.dtype, q.device)
        q_own, pos_own = q[:, :keep], positions[r][:keep]
        add_block(impl, acc, q_own, k, v, pos_own, positions[r], causal, scale, chunk)
        blocks = pending.wait()
        for j in range(n):
            if j != r:
                kv_j = blocks[j, :, : lengths[j]]
                add_block(impl, acc, q_own, kv_j[..., :d], kv_j[..., d:], pos_own, positions[j],
                          causal, scale, chunk)  # fmt: skip
        out = acc.out.to(q.dtype)
        guest: tuple[torch.Tensor | None, ...] = (None, None, None)  # q, out, lse of borrowed rows
        if take is not None:
            assert got is not None
            q_in = got[0]
            pos_in = positions[take.owner][take.row0 :]
            acc_in = LseAccumulator(bf, take.rows, h, dv, q.dtype, q.device)
            for j in range(n):
                kv_j = blocks[j, :, : lengths[j]]
                add_block(impl, acc_in, q_in, kv_j[..., :d], kv_j[..., d:], pos_in,
                          positions[j], causal, scale, chunk)  # fmt: skip
            guest = (q_in, acc_in.out.to(q.dtype), acc_in.lse)
        if loans:  # the borrowed rows go back finished
            incoming = ((bf, give.rows, h, dv), q.dtype) if give is not None else None
            back = _lend(loans, r, guest[1], incoming, False, where, _LOAN_TAG + 1).wait()
            if give is not None:
                out = torch.cat([out, back[0]], dim=1)
        # the own block is read back from its slot of the gathered buffer: k and v are not kept
        ctx.save_for_backward(q, blocks, out, acc.lse, *guest)
        ctx.args = (group, positions, causal, scale, impl, chunk, region, k.dtype, v.dtype, loans)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, blocks, out, lse, q_in, out_in, lse_in = ctx.saved_tensors
        group, positions, causal, scale, impl, chunk, region, k_dtype, v_dtype, loans = ctx.args
        n, r = group_size(group), group_rank(group)
        lengths, d = [p.numel() for p in positions], q.shape[-1]
        give, take = _roles(loans, r)
        where = (group, q.device, "backward", region)
        keep = give.row0 if give is not None else q.shape[1]
        dout = dout.contiguous()
        dout_in = None
        if loans:  # the borrowed rows' dO, first
            incoming = (tuple(out_in.shape), dout.dtype) if take is not None else None
            got = _lend(loans, r, dout[:, keep:], incoming, True, where, _LOAN_TAG + 2).wait()
            dout_in = got[0] if take is not None else None
        q_own, out_own, dout_own, pos_own = (
            q[:, :keep],
            out[:, :keep],
            dout[:, :keep],
            positions[r][:keep],
        )
        own = blocks[r, :, : lengths[r]]
        k, v = own[..., :d], own[..., d:]
        dt = stats_dtype(q.dtype)
        dq = torch.zeros(q_own.shape, dtype=dt, device=q.device)
        dq_in = torch.zeros(q_in.shape, dtype=dt, device=q.device) if take is not None else None
        dblocks = torch.zeros(blocks.shape, dtype=dt, device=q.device)  # own slot stays 0
        rows = [(q_own, out_own, lse, dout_own, pos_own, dq)]
        if take is not None:
            rows.append((q_in, out_in, lse_in, dout_in, positions[take.owner][take.row0 :], dq_in))
        for q_x, out_x, lse_x, dout_x, pos_x, dq_x in rows:
            for j in range(n):
                if j != r:
                    kv_j, g_j = blocks[j, :, : lengths[j]], dblocks[j, :, : lengths[j]]
                    add_block_grads(impl, (dq_x, g_j[..., :d], g_j[..., d:]), q_x, kv_j[..., :d],
                                    kv_j[..., d:], out_x, lse_x, dout_x, pos_x, positions[j],
                                    causal, scale, chunk)  # fmt: skip
        pending = _start_kv_reduce_scatter(dblocks, k_dtype, group, region)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)
        for q_x, out_x, lse_x, dout_x, pos_x, dq_x in rows:
            add_block_grads(impl, (dq_x, dk, dv), q_x, k, v, out_x, lse_x, dout_x, pos_x,
                            positions[r], causal, scale, chunk)  # fmt: skip
        mine = pending.wait()[:, : lengths[r]]
        dk += mine[..., :d]
        dv += mine[..., d:]
        dq = dq.to(q.dtype)
        if loans:  # the borrowed rows' dQ go back
            incoming = ((*q.shape[:1], give.rows, *q.shape[2:]), q.dtype) if give else None
            sent = dq_in.to(q.dtype) if dq_in is not None else None
            back = _lend(loans, r, sent, incoming, False, where, _LOAN_TAG + 3).wait()
            if give is not None:
                dq = torch.cat([dq, back[0]], dim=1)
        return (dq, dk.to(k_dtype), dv.to(v_dtype)) + (None,) * 8

"""Autograd-aware collectives on the sequence-parallel group, exact for uneven lengths.

The four primitives of DSP (plus the one a protein trunk needs) act on a tensor axis ``dim``:

=========================  ===========================  ====================================
primitive                  layout change                backward
=========================  ===========================  ====================================
``split``                  replicated → sharded         keep own slice in place (no comm)
``gather``                 sharded → replicated         own slice of the gradient × N
``gather_for_local_use``   sharded → full, per-rank use reduce-scatter (sum)
``switch``                 sharded on src → on dst      reverse switch (one all-to-all)
=========================  ===========================  ====================================

Gradient contract (see ``docs/gradient_contract.md``): every backward above is the exact
adjoint of its forward over the SP group, and each SP rank's loss is normalised so that the
*mean* of the losses over the SP group equals the full-sample loss (a loss on replicated data
is just computed on every rank; a loss on sharded tokens uses :func:`dspzoo.core.loss.sp_mean`).
Averaging parameter gradients over the whole dp × sp world, which DDP and FSDP do by default,
then gives exactly the gradient of the single-process computation. ``gather``'s "× N" is the
adjoint under its precondition that what follows it is computed identically on every rank; a
tensor consumed *differently* per rank (the other operand of a triangle multiplication, K/V for
local queries) must use ``gather_for_local_use``, whose backward reduce-scatters.

Shards are balanced and unpadded (:func:`dspzoo.core.layout.shard_sizes`). A switch moves
exactly the blocks other ranks need, laid out by one copy so that a single
``all_to_all_single`` (with per-rank split sizes when lengths are uneven) does the exchange and
the received buffer is the result, or needs one more copy when leading axes are not trivial.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .layout import shard_sizes
from .trace import current_region, record_comm

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DEBUG = os.environ.get("DSPZOO_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug(enabled: bool) -> None:
    """Turn on cross-rank consistency checks before every collective (costs one small all-gather)."""
    global _DEBUG
    _DEBUG = enabled


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (``None`` means a one-rank group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank inside ``group``."""
    return 0 if group is None else dist.get_rank(group)


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _norm_dim(x: torch.Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def check_consistent(
    x: torch.Tensor,
    group: Any,
    what: str,
    args: tuple[int, ...] = (),
    free_axes: tuple[int, ...] = (),
) -> None:
    """Raise on every rank if ranks disagree on a collective's arguments or tensor sizes.

    Debug-mode check run before a collective so that a mismatch raises a clear error instead
    of hanging or exchanging garbage. ``args`` are call arguments (dims, lengths) that must be
    equal; ``free_axes`` are the axes whose sizes legitimately differ per rank (shards).
    """
    n = group_size(group)
    if n == 1:
        return
    shape = [-1 if i in free_axes else s for i, s in enumerate(x.shape)]
    meta = [x.dim(), *args, *shape, _DTYPE_CODES.get(x.dtype, 99)]
    if len(meta) > 32:
        raise ValueError(f"{what}: too many dims to check ({x.dim()})")
    meta += [0] * (32 - len(meta))
    # on the data's device: NCCL only moves CUDA tensors
    everyone = torch.empty(n * 32, dtype=torch.long, device=x.device)
    _all_gather_single(everyone, torch.tensor(meta, dtype=torch.long, device=x.device), group=group)
    rows = everyone.view(n, 32).cpu()
    if not bool((rows == rows[0]).all()):
        detail = "; ".join(
            f"rank {q}: ndim={int(row[0])} args={row[1 : 1 + len(args)].tolist()} shape={row[1 + len(args) : 1 + len(args) + int(row[0])].tolist()}"
            for q, row in enumerate(rows)
        )
        raise ValueError(
            f"{what}: ranks of the SP group disagree on arguments or shapes (-1 = sharded axis): {detail}"
        )


_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.bool,
        )
    )
}


def _debug_check(
    x: torch.Tensor,
    group: Any,
    what: str,
    args: tuple[int, ...],
    free_axes: tuple[int, ...],
    error: Exception | None,
) -> None:
    """:func:`check_consistent` plus a flag for a local error, so every rank raises together."""
    try:
        check_consistent(x, group, what, (*args, int(error is None)), free_axes)
    except ValueError as exc:
        raise ValueError(
            f"{exc} (last arg 0 = that rank found its input invalid: {error})"
        ) from error


def _record(
    op: str, bytes_sent: int, group: Any, x: torch.Tensor, phase: str, region: str | None
) -> None:
    record_comm(op, bytes_sent, group_size(group), x, phase=phase, region=region)


# --------------------------------------------------------------------------------------------
# block layout helpers


_SEND_WORKSPACE: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor | None:
    """A reusable send buffer for synchronous CPU collectives (``None`` elsewhere).

    On CPU a fresh multi-MiB buffer costs page faults comparable to the copy itself; the
    workspace keeps one buffer per dtype, as large as the largest switch so far.
    """
    if like.device.type != "cpu":
        return None
    key = (str(like.device), like.dtype)
    buf = _SEND_WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _SEND_WORKSPACE[key] = buf
    return buf[:numel]


def _pack_blocks(x: torch.Tensor, axis: int, sizes: list[int], reuse: bool = False) -> torch.Tensor:
    """Flat buffer of the blocks ``x.narrow(axis, off_q, sizes[q])`` in rank order.

    Each block keeps ``x``'s own axis order, so the receiver can read a block as a tensor.
    Equal sizes: one copy at most (none when every axis before ``axis`` has size 1). With
    ``reuse`` the copy goes into the CPU workspace (only for buffers consumed at once).
    """
    n = len(sizes)
    if len(set(sizes)) == 1:
        blocks = x.unflatten(axis, (n, sizes[0])).movedim(axis, 0)
        if blocks.is_contiguous():
            return blocks.view(-1)
        out = _workspace(x.numel(), x) if reuse else None
        if out is None:
            return blocks.contiguous().view(-1)
        out.view(blocks.shape).copy_(blocks)
        return out
    parts = [x.narrow(axis, off, size).reshape(-1) for off, size in zip(_offsets(sizes), sizes)]
    return torch.cat(parts)


def _unpack_blocks(
    flat: torch.Tensor, axis: int, sizes: list[int], shape: list[int]
) -> torch.Tensor:
    """Inverse of :func:`_pack_blocks`: blocks of ``shape`` (with ``sizes[q]`` on ``axis``) joined on ``axis``.

    Equal sizes: a view when every axis before ``axis`` has size 1, else one copy.
    """
    n = len(sizes)
    if len(set(sizes)) == 1:
        block = list(shape)
        block[axis] = sizes[0]
        return flat.view(n, *block).movedim(0, axis).flatten(axis, axis + 1)
    parts, start = [], 0
    for size in sizes:
        block = list(shape)
        block[axis] = size
        count = math.prod(block)
        parts.append(flat[start : start + count].view(block))
        start += count
    return torch.cat(parts, dim=axis)


# --------------------------------------------------------------------------------------------
# split / gather


def split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Replicated → sharded: keep this rank's balanced slice of axis ``dim``.

    ``x`` must be identical on every rank of ``group``. Shape ``[..., L, ...]`` →
    ``[..., shard_sizes(L, N)[rank], ...]``. No communication, forward or backward.
    """
    dim = _norm_dim(x, dim, "split")
    if group_size(group) == 1:
        return x
    return _Split.apply(x, dim, group)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        sizes = shard_sizes(x.shape[dim], n)
        ctx.dim, ctx.full, ctx.offset = dim, x.shape[dim], _offsets(sizes)[r]
        return x.narrow(dim, ctx.offset, sizes[r]).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        out = grad.new_zeros(shape)
        out.narrow(ctx.dim, ctx.offset, grad.shape[ctx.dim]).copy_(grad)
        return out, None, None


def _all_gather_along(
    x: torch.Tensor, dim: int, sizes: list[int], group: Any, phase: str, region: str | None
) -> torch.Tensor:
    """All-gather shards of axis ``dim`` (sizes per rank) into the full tensor."""
    n, r = group_size(group), group_rank(group)
    error = None
    if x.shape[dim] != sizes[r]:
        error = ValueError(
            f"gather: rank {r} holds {x.shape[dim]} rows of dim {dim} but a length of {sum(sizes)} "
            f"over {n} ranks gives it {sizes[r]}; pass the true global length"
        )
    if _DEBUG:
        _debug_check(x, group, "gather", (dim, sum(sizes)), (dim,), error)
    if error is not None:
        raise error
    longest = max(sizes)
    if x.shape[dim] == longest:
        buf = x.contiguous()
    else:
        padded = list(x.shape)
        padded[dim] = longest
        buf = x.new_zeros(padded)
        buf.narrow(dim, 0, x.shape[dim]).copy_(x)
    out = torch.empty((n, *buf.shape), dtype=x.dtype, device=x.device)
    _all_gather_single(out.view(-1), buf.view(-1), group=group)
    _record("all_gather", (n - 1) * buf.numel() * buf.element_size(), group, buf, phase, region)
    if len(set(sizes)) == 1:
        return out.movedim(0, dim).flatten(dim, dim + 1)
    return torch.cat([out[q].narrow(dim, 0, sizes[q]) for q in range(n)], dim=dim)


def _reduce_scatter_along(
    grad: torch.Tensor, dim: int, sizes: list[int], group: Any, region: str | None
) -> torch.Tensor:
    """Sum ``grad`` (full on ``dim``) over the group and keep this rank's shard of ``dim``."""
    n, r = group_size(group), group_rank(group)
    longest = max(sizes)
    block = list(grad.shape)
    block[dim] = longest
    if len(set(sizes)) == 1:
        buf = _pack_blocks(grad, dim, sizes)
    else:
        buf = grad.new_zeros((n, *block))
        for q, (off, size) in enumerate(zip(_offsets(sizes), sizes)):
            buf[q].narrow(dim, 0, size).copy_(grad.narrow(dim, off, size))
        buf = buf.view(-1)
    out = torch.empty(block, dtype=grad.dtype, device=grad.device)
    _reduce_scatter_single(out.view(-1), buf, group=group)
    _record(
        "reduce_scatter", (n - 1) * out.numel() * out.element_size(), group, out, "backward", region
    )
    return out.narrow(dim, 0, sizes[r])


def _resolve_length(x: torch.Tensor, dim: int, group: Any, length: int | None) -> int:
    """The global length of sharded axis ``dim``: ``length`` if given, else summed over ranks."""
    if length is not None:
        return int(length)
    local = torch.tensor([x.shape[dim]], dtype=torch.long, device=x.device)  # NCCL: CUDA only
    dist.all_reduce(local, group=group)
    _record(
        "size_sync",
        8 * 2 * (group_size(group) - 1) // group_size(group),
        group,
        local,
        "forward",
        None,
    )
    return int(local.item())


def gather(x: torch.Tensor, dim: int, group: Any, length: int | None = None) -> torch.Tensor:
    """Sharded → replicated: all-gather axis ``dim`` to its full ``length``.

    Use when what follows is computed *identically* on every rank (a final layer, a loss on
    the whole output, sampling). Backward keeps this rank's slice of the gradient, scaled by
    the group size (the adjoint under that precondition; see the module docstring). If
    ``length`` is omitted it is found with one tiny all-reduce.

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``.
    """
    dim = _norm_dim(x, dim, "gather")
    if group_size(group) == 1:
        return x
    length = _resolve_length(x, dim, group, length)
    return _Gather.apply(x, dim, group, length)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, length: int) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        sizes = shard_sizes(length, n)
        ctx.dim, ctx.n, ctx.offset, ctx.size = dim, n, _offsets(sizes)[r], sizes[r]
        return _all_gather_along(x, dim, sizes, group, "forward", None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.narrow(ctx.dim, ctx.offset, ctx.size) * ctx.n, None, None, None


def gather_for_local_use(
    x: torch.Tensor, dim: int, group: Any, length: int | None = None
) -> torch.Tensor:
    """All-gather axis ``dim`` for a use that differs per rank; backward reduce-scatters.

    For full-length operands each rank combines with its *own* shard of something else, e.g.
    keys/values for local queries, a triangle-multiplication operand, a pair bias. The
    gradients of the gathered tensor differ per rank and are summed back to their owners.

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``.
    """
    dim = _norm_dim(x, dim, "gather_for_local_use")
    if group_size(group) == 1:
        return x
    length = _resolve_length(x, dim, group, length)
    return _GatherForLocalUse.apply(x, dim, group, length, current_region())


class _GatherForLocalUse(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: Any, length: int, region: str
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.region = dim, group, region
        ctx.sizes = shard_sizes(length, group_size(group))
        return _all_gather_along(x, dim, ctx.sizes, group, "forward", region)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (
            _reduce_scatter_along(grad, ctx.dim, ctx.sizes, ctx.group, ctx.region),
            None,
            None,
            None,
            None,
        )


# --------------------------------------------------------------------------------------------
# switch


@dataclass(frozen=True)
class _SwitchMeta:
    """Sizes of one switch on one rank: ``x`` sharded on ``src`` → ``y`` sharded on ``dst``."""

    src: int
    dst: int
    src_sizes: list[int]
    dst_sizes: list[int]
    x_shape: list[int]
    y_shape: list[int]
    send_splits: list[int]
    recv_splits: list[int]
    rank: int

    @classmethod
    def build(
        cls, x: torch.Tensor, src: int, dst: int, src_length: int, n: int, r: int
    ) -> _SwitchMeta:
        src_sizes = shard_sizes(src_length, n)
        dst_sizes = shard_sizes(x.shape[dst], n)
        if x.shape[src] != src_sizes[r]:
            raise ValueError(
                f"switch: rank {r} holds {x.shape[src]} rows of source dim {src}, but a global "
                f"length of {src_length} over {n} ranks gives it {src_sizes[r]} (shape {tuple(x.shape)})"
            )
        rest = math.prod(s for i, s in enumerate(x.shape) if i not in (src, dst))
        y_shape = list(x.shape)
        y_shape[src], y_shape[dst] = src_length, dst_sizes[r]
        return cls(
            src=src,
            dst=dst,
            src_sizes=src_sizes,
            dst_sizes=dst_sizes,
            x_shape=list(x.shape),
            y_shape=y_shape,
            send_splits=[src_sizes[r] * b * rest for b in dst_sizes],
            recv_splits=[a * dst_sizes[r] * rest for a in src_sizes],
            rank=r,
        )

    @property
    def even(self) -> bool:
        return len(set(self.send_splits)) == 1 and len(set(self.recv_splits)) == 1

    def reverse(self) -> _SwitchMeta:
        """The switch that undoes this one (used by backward)."""
        return _SwitchMeta(
            src=self.dst,
            dst=self.src,
            src_sizes=self.dst_sizes,
            dst_sizes=self.src_sizes,
            x_shape=self.y_shape,
            y_shape=self.x_shape,
            send_splits=self.recv_splits,
            recv_splits=self.send_splits,
            rank=self.rank,
        )

    def pack(self, x: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        return _pack_blocks(x, self.dst, self.dst_sizes, reuse)

    def pack_remote(self, x: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """Like :meth:`pack` without this rank's own block (first or last rank only)."""
        n, r = len(self.dst_sizes), self.rank
        keep = range(1, n) if r == 0 else range(n - 1)
        if len(set(self.dst_sizes)) == 1:
            blocks = x.unflatten(self.dst, (n, self.dst_sizes[0])).movedim(self.dst, 0)
            blocks = blocks[keep.start : keep.stop]
            out = _workspace(blocks.numel(), x) if reuse else None
            if out is None:
                return blocks.contiguous().view(-1)
            out.view(blocks.shape).copy_(blocks)
            return out
        offsets = _offsets(self.dst_sizes)
        return torch.cat(
            [x.narrow(self.dst, offsets[q], self.dst_sizes[q]).reshape(-1) for q in keep]
        )

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        return _unpack_blocks(flat, self.src, self.src_sizes, self.y_shape)

    def bytes_sent(self, itemsize: int) -> int:
        return (sum(self.send_splits) - self.send_splits[self.rank]) * itemsize


def _start_all_to_all(
    x: torch.Tensor, meta: _SwitchMeta, group: Any, async_op: bool
) -> tuple[torch.Tensor, Any]:
    """Launch the exchange of one switch; returns the receive buffer and ``(work, send)``.

    On the first and last rank of the group the rank's own block sits at an end of both the
    send and the receive buffer, so it is left out of the collective (split size 0) and copied
    straight from ``x`` into place while the remote blocks travel: the pack copy shrinks by
    ``1/N`` and the local copy overlaps the transfer.
    """
    n, r = len(meta.send_splits), meta.rank
    out = torch.empty(sum(meta.recv_splits), dtype=x.dtype, device=x.device)
    if r not in (0, n - 1):
        send = meta.pack(x, reuse=not async_op)
        work = dist.all_to_all_single(
            out, send, meta.recv_splits, meta.send_splits, group=group, async_op=async_op
        )
        return out, (work, send)
    own_recv, own_send = meta.recv_splits[r], meta.send_splits[r]
    remote_out = out[own_recv:] if r == 0 else out[: out.numel() - own_recv]
    send = meta.pack_remote(x, reuse=not async_op)
    send_splits, recv_splits = list(meta.send_splits), list(meta.recv_splits)
    send_splits[r] = recv_splits[r] = 0
    work = dist.all_to_all_single(
        remote_out, send, recv_splits, send_splits, group=group, async_op=True
    )
    own_start = 0 if r == 0 else out.numel() - own_recv
    own = x.narrow(meta.dst, _offsets(meta.dst_sizes)[r], meta.dst_sizes[r])
    assert own.numel() == own_send == own_recv
    out[own_start : own_start + own_recv].view(own.shape).copy_(own)
    if not async_op:
        work.wait()
        work = None
    return out, (work, send)


def _switch_now(
    x: torch.Tensor, meta: _SwitchMeta, group: Any, phase: str, region: str | None
) -> torch.Tensor:
    out, _ = _start_all_to_all(x, meta, group, async_op=False)
    _record("all_to_all", meta.bytes_sent(x.element_size()), group, x, phase, region)
    return meta.unpack(out)


class _Switch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, meta: _SwitchMeta, group: Any, region: str
    ) -> torch.Tensor:
        ctx.meta, ctx.group, ctx.region = meta, group, region
        return _switch_now(x, meta, group, "forward", region)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (
            _switch_now(grad, ctx.meta.reverse(), ctx.group, "backward", ctx.region),
            None,
            None,
            None,
        )


def _switch_meta(
    x: torch.Tensor, src: int, dst: int, group: Any, src_length: int | None
) -> _SwitchMeta:
    src, dst = _norm_dim(x, src, "switch"), _norm_dim(x, dst, "switch")
    if src == dst:
        raise ValueError(f"switch: source and destination dims are both {src}; nothing to switch")
    src_length = _resolve_length(x, src, group, src_length)
    meta, error = None, None
    try:
        meta = _SwitchMeta.build(x, src, dst, src_length, group_size(group), group_rank(group))
    except ValueError as exc:
        error = exc
    if _DEBUG:
        _debug_check(x, group, "switch", (src, dst, src_length), (src,), error)
    if error is not None:
        raise error
    return meta


def switch(
    x: torch.Tensor, src: int, dst: int, group: Any, src_length: int | None = None
) -> torch.Tensor:
    """Sharded on axis ``src`` → sharded on axis ``dst`` with one ``all_to_all_single``.

    Shape ``[.., a_r, .., L_dst, ..]`` → ``[.., L_src, .., b_r, ..]`` where ``a_r`` and ``b_r``
    are this rank's balanced shards of the global ``src_length`` and of ``L_dst``. Each rank
    sends ``(local elements)·(N−1)/N`` when lengths divide evenly. Backward is the reverse
    switch. If ``src_length`` is omitted it is found with one tiny all-reduce.
    """
    if group_size(group) == 1:
        return x
    meta = _switch_meta(x, src, dst, group, src_length)
    return _Switch.apply(x, meta, group, current_region())


class SwitchHandle:
    """An in-flight :func:`switch_async`; call :meth:`wait` to get the switched tensor."""

    def __init__(self, meta: _SwitchMeta | None, group: Any, region: str) -> None:
        self.meta, self.group, self.region = meta, group, region
        self.work: Any = None
        self._buffers: Any = None
        self._pending: torch.Tensor | None = None
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the exchange is done and return the switched tensor (idempotent)."""
        if self._result is None:
            assert self._pending is not None
            self._result = _SwitchFinish.apply(self._pending, self)
            self._pending = None
        return self._result


class _SwitchStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: SwitchHandle) -> torch.Tensor:
        meta = handle.meta
        out, (work, send) = _start_all_to_all(x, meta, handle.group, async_op=True)
        handle.work, handle._buffers = work, send
        _record(
            "all_to_all",
            meta.bytes_sent(x.element_size()),
            handle.group,
            x,
            "forward",
            handle.region,
        )
        ctx.meta, ctx.group, ctx.region = meta, handle.group, handle.region
        return out

    @staticmethod
    def backward(ctx: Any, grad_flat: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rev = ctx.meta.reverse()
        out = torch.empty(sum(rev.recv_splits), dtype=grad_flat.dtype, device=grad_flat.device)
        grad_flat = grad_flat.contiguous()
        if rev.even:
            dist.all_to_all_single(out, grad_flat, group=ctx.group)
        else:
            dist.all_to_all_single(
                out, grad_flat, rev.recv_splits, rev.send_splits, group=ctx.group
            )
        _record(
            "all_to_all",
            rev.bytes_sent(grad_flat.element_size()),
            ctx.group,
            grad_flat,
            "backward",
            ctx.region,
        )
        return rev.unpack(out), None


class _SwitchFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, handle: SwitchHandle) -> torch.Tensor:
        if handle.work is not None:
            handle.work.wait()
        handle._buffers = None
        ctx.meta = handle.meta
        return handle.meta.unpack(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.meta.reverse().pack(grad), None


def switch_async(
    x: torch.Tensor, src: int, dst: int, group: Any, src_length: int | None = None
) -> SwitchHandle:
    """Start a :func:`switch` and return a :class:`SwitchHandle` at once.

    Compute that does not depend on the result can run before ``handle.wait()``; the forward
    exchange overlaps it. The backward exchange is synchronous. Do not modify ``x`` in place
    before ``wait``.
    """
    if group_size(group) == 1:
        handle = SwitchHandle(None, group, current_region())
        handle._result = x
        return handle
    meta = _switch_meta(x, src, dst, group, src_length)
    handle = SwitchHandle(meta, group, current_region())
    handle._pending = _SwitchStart.apply(x, handle)
    return handle


# --------------------------------------------------------------------------------------------
# small helpers


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (no autograd; for counts and metrics)."""
    if group_size(group) == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    n = group_size(group)
    _record(
        "all_reduce", 2 * (n - 1) * x.numel() * x.element_size() // n, group, x, "forward", None
    )
    return x

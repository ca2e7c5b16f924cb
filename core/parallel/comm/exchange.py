"""``switch`` and ``switch_async``: sharded on one axis → sharded on another, one all-to-all.

Both go through the same three steps: :func:`_launch` (pack once, start one
``all_to_all_single``), :meth:`SwitchHandle.wait` (finish it and unpack, as the forward of the
autograd node :class:`_Switch`), and :meth:`_Switch.backward`, the one adjoint of both: the
reverse switch, run synchronously. ``switch`` is ``switch_async(...).wait()`` without the
asynchronous launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..layout import shard_sizes
from ..trace import current_region
from .agreement import Agreed, Signature, agree, guard, skips_agreement
from .blocks import empty_blocks, offsets, pack_blocks, unpack_blocks
from .group import group_rank, group_size, norm_dim, record
from .settings import SETTINGS


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
        cls,
        x: torch.Tensor,
        src: int,
        dst: int,
        src_length: int,
        n: int,
        r: int,
        src_sizes: list[int] | None = None,
        dst_sizes: list[int] | None = None,
    ) -> _SwitchMeta:
        """This rank's sizes; the lists are the meta's own (a caller may reuse its lists).
        The arguments were agreed (or are the runtime's own); only this rank's rows are
        checked here."""
        src_sizes = shard_sizes(src_length, n) if src_sizes is None else list(src_sizes)
        dst_sizes = shard_sizes(x.shape[dst], n) if dst_sizes is None else list(dst_sizes)
        if x.shape[src] != src_sizes[r]:
            raise ValueError(
                f"switch: rank {r} holds {x.shape[src]} rows of source dim {src}, but a global "
                f"length of {src_length} over {n} ranks gives it {src_sizes[r]} (shape {tuple(x.shape)})"
            )
        rest = math.prod(s for i, s in enumerate(x.shape) if i not in (src, dst))
        y_shape = list(x.shape)
        y_shape[src], y_shape[dst] = src_length, dst_sizes[r]
        send = [src_sizes[r] * b * rest for b in dst_sizes]
        recv = [a * dst_sizes[r] * rest for a in src_sizes]
        return cls(src, dst, src_sizes, dst_sizes, list(x.shape), y_shape, send, recv, r)

    def reverse(self) -> _SwitchMeta:
        """The switch that undoes this one (the adjoint)."""
        return _SwitchMeta(
            self.dst, self.src, self.dst_sizes, self.src_sizes, self.y_shape, self.x_shape,
            self.recv_splits, self.send_splits, self.rank,
        )  # fmt: skip

    def bytes_sent(self, itemsize: int) -> int:
        return (sum(self.send_splits) - self.send_splits[self.rank]) * itemsize


def _launch(
    x: torch.Tensor, meta: _SwitchMeta, group: Any, async_op: bool
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """Start the exchange of one switch; ``(receive buffer, work, send buffer)``.

    ``work`` is ``None`` once the exchange is complete (always, unless ``async_op``). The send
    buffer must stay alive until then; :func:`unpack_blocks` makes the result from the
    receive buffer (which is the result itself when the leading axes are trivial).

    On the first and last rank of the group the rank's own block sits at an end of both the
    send and the receive buffer, so it is left out of the collective (split size 0) and copied
    straight from ``x`` into place while the remote blocks travel: the pack copy shrinks by
    ``1/N`` and the local copy overlaps the transfer.
    """
    n, r = len(meta.send_splits), meta.rank
    recv = empty_blocks(meta.y_shape, meta.src, meta.src_sizes, x)
    flat = recv.view(-1)
    if r not in (0, n - 1):
        send = pack_blocks(x, meta.dst, meta.dst_sizes)
        work = dist.all_to_all_single(
            flat, send, meta.recv_splits, meta.send_splits, group=group, async_op=async_op
        )
        return recv, work, send
    own_recv = meta.recv_splits[r]
    remote_out = flat[own_recv:] if r == 0 else flat[: flat.numel() - own_recv]
    keep = range(1, n) if r == 0 else range(n - 1)
    send = pack_blocks(x, meta.dst, meta.dst_sizes, keep=keep)
    send_splits, recv_splits = list(meta.send_splits), list(meta.recv_splits)
    send_splits[r] = recv_splits[r] = 0
    work = dist.all_to_all_single(
        remote_out, send, recv_splits, send_splits, group=group, async_op=True
    )
    own_start = 0 if r == 0 else flat.numel() - own_recv
    own = x.narrow(meta.dst, offsets(meta.dst_sizes)[r], meta.dst_sizes[r])
    flat[own_start : own_start + own_recv].view(own.shape).copy_(own)
    if not async_op:
        work.wait()
        work = None
    return recv, work, send


def _switch_now(
    x: torch.Tensor, meta: _SwitchMeta, group: Any, phase: str, region: str
) -> torch.Tensor:
    """One synchronous switch, no autograd: launch, wait, unpack."""
    with guard(f"switch ({phase})", group, region, x.device):
        recv, _, _ = _launch(x, meta, group, async_op=False)
    record("all_to_all", meta.bytes_sent(x.element_size()), group, x, phase, region)
    return unpack_blocks(recv, meta.src, meta.src_sizes, meta.y_shape)


class SwitchHandle:
    """An in-flight :func:`switch_async`; call :meth:`wait` to get the switched tensor."""

    def __init__(
        self, meta: _SwitchMeta | None, group: Any, region: str, primitive: str = "switch_async"
    ) -> None:
        self.meta, self.group, self.region, self.primitive = meta, group, region, primitive
        self.work: Any = None
        self._input: torch.Tensor | None = None  # the autograd input of the switch
        self._recv: torch.Tensor | None = None
        self._send: torch.Tensor | None = None  # kept alive until the exchange completes
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the exchange is done and return the switched tensor (idempotent)."""
        if self._result is None:
            assert self._input is not None
            self._result = _Switch.apply(self._input, self)
            self._input = None
        return self._result

    def _finish(self) -> torch.Tensor:
        """Wait for the exchange and unpack the received blocks (no autograd)."""
        if self.work is not None:
            with guard(self.primitive, self.group, self.region):
                self.work.wait()
            self.work = None
        assert self.meta is not None and self._recv is not None
        meta, recv = self.meta, self._recv
        self._recv = self._send = None
        return unpack_blocks(recv, meta.src, meta.src_sizes, meta.y_shape)


class _Switch(torch.autograd.Function):
    """``y = switch(x)``, launched before ``apply``; backward is the reverse switch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: SwitchHandle) -> torch.Tensor:
        ctx.meta, ctx.group, ctx.region = handle.meta, handle.group, handle.region
        return handle._finish()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if SETTINGS.debug:  # autograd already guarantees the gradient's shape and dtype
            sig = Signature("switch").tensor("grad", grad, sharded=(ctx.meta.dst,))
            agree(sig, ctx.group, grad.device)
        return _switch_now(grad, ctx.meta.reverse(), ctx.group, "backward", ctx.region), None


def agree_switch(
    x: torch.Tensor,
    src: int,
    dst: int,
    group: Any,
    src_length: int | None,
    src_sizes: list[int] | None,
    dst_sizes: list[int] | None,
    primitive: str,
) -> tuple[_SwitchMeta, Agreed]:
    """Check the arguments on every rank together; this rank's meta and the agreement.

    Every rank raises the same :class:`~.agreement.CollectiveInputError` if any rank's
    dims, lengths, split sizes, dtype, device or whole-axis sizes differ from the others', or
    its shard of ``src`` is not the one the length gives it.
    """
    n, r = group_size(group), group_rank(group)
    sig, src, dst = _switch_signature(
        x, src, dst, src_length, src_sizes, dst_sizes, n, r, primitive
    )
    src_sizes = None if src_sizes is None else [int(s) for s in src_sizes]
    dst_sizes = None if dst_sizes is None else [int(s) for s in dst_sizes]
    agreed = agree(sig, group, x.device, needs_rows=src_length is None and src_sizes is None)
    rows = f"rows of dim {src}"
    if src_sizes is not None:
        want, how = src_sizes, f"src_sizes {src_sizes}"
    elif src_length is not None:
        want, how = shard_sizes(src_length, n), f"a global length of {src_length} over {n} ranks"
    else:  # the length is the sum of the shards, which must then be balanced
        src_length = sum(v[0] for v in agreed.local(rows))
        want, how = shard_sizes(src_length, n), f"balanced shards of their sum {src_length}"
    agreed.check_rows(rows, want, how)
    length = sum(src_sizes) if src_sizes is not None else src_length
    return _SwitchMeta.build(x, src, dst, length, n, r, src_sizes, dst_sizes), agreed


def _tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def _switch_signature(
    x: torch.Tensor,
    src: int,
    dst: int,
    src_length: int | None,
    src_sizes: list[int] | None,
    dst_sizes: list[int] | None,
    n: int,
    r: int,
    primitive: str,
) -> tuple[Signature, int, int]:
    """This rank's signature of a switch call, with ``src`` and ``dst`` normalised.

    A problem found here is kept in ``sig.error`` (shared with every rank by the agreement).
    """
    sig = Signature(primitive)
    try:
        src_sizes = None if src_sizes is None else [int(s) for s in src_sizes]
        dst_sizes = None if dst_sizes is None else [int(s) for s in dst_sizes]
        src, dst = norm_dim(x, src, primitive), norm_dim(x, dst, primitive)
        if src == dst:
            raise ValueError(f"source and destination dims are both {src}; nothing to switch")
        sig.arg("src", src).arg("dst", dst).arg("src_length", src_length)
        sig.sizes("src_sizes", src_sizes).sizes("dst_sizes", dst_sizes)
        sig.tensor("x", x, sharded=(src,)).local(f"rows of dim {src}", x.shape[src])
        _check_sizes("src_sizes", src_sizes, n, src_length)
        _check_sizes("dst_sizes", dst_sizes, n, x.shape[dst])
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    return sig, src, dst


def _check_sizes(name: str, sizes: list[int] | None, n: int, length: int | None) -> None:
    """``sizes`` must give each of the ``n`` ranks a non-negative share of ``length``."""
    if sizes is None:
        return
    if len(sizes) != n or min(sizes) < 0 or (length is not None and sum(sizes) != length):
        raise ValueError(
            f"{name} {sizes} must give each of the {n} ranks a non-negative share"
            + ("" if length is None else f" of the length {length}")
        )


def _start(
    x: torch.Tensor,
    src: int,
    dst: int,
    group: Any,
    src_length: int | None,
    async_op: bool,
    src_sizes: list[int] | None = None,
    dst_sizes: list[int] | None = None,
) -> SwitchHandle:
    """Agree on the arguments (unless the call is trusted), launch the forward exchange, return
    its handle."""
    primitive = "switch_async" if async_op else "switch"
    region = current_region()
    lengthless = src_length is None and src_sizes is None
    if lengthless or not skips_agreement(group):
        args = (x, src, dst, group, src_length, src_sizes, dst_sizes, primitive)
        meta, _ = agree_switch(*args)
    else:  # trusted: agreed at the runtime's (or the method's) entry
        meta = _unchecked_meta(x, src, dst, group, src_length, src_sizes, dst_sizes, primitive)
    handle = SwitchHandle(meta, group, region, primitive)
    with torch.no_grad(), guard(primitive, group, handle.region, x.device):
        handle._recv, handle.work, handle._send = _launch(x.detach(), meta, group, async_op)
    record("all_to_all", meta.bytes_sent(x.element_size()), group, x, "forward", handle.region)
    handle._input = x
    return handle


_METAS: dict[tuple, _SwitchMeta] = {}  # unchecked calls' metas by their arguments (pure)


def _unchecked_meta(
    x: torch.Tensor,
    src: int,
    dst: int,
    group: Any,
    src_length: int | None,
    src_sizes: list[int] | None,
    dst_sizes: list[int] | None,
    primitive: str,
) -> _SwitchMeta:
    """This rank's meta of an unchecked switch, computed once per distinct call."""
    n, r = group_size(group), group_rank(group)
    key = (tuple(x.shape), src, dst, src_length, _tuple(src_sizes), _tuple(dst_sizes), n, r)
    meta = _METAS.get(key)
    if meta is None:
        src, dst = norm_dim(x, src, primitive), norm_dim(x, dst, primitive)
        length = sum(src_sizes) if src_sizes is not None else src_length
        assert length is not None, "an unchecked switch needs src_length or src_sizes"
        meta = _SwitchMeta.build(x, src, dst, length, n, r, src_sizes, dst_sizes)
        _METAS[key] = meta
        while len(_METAS) > 256:
            _METAS.pop(next(iter(_METAS)))
    return meta


def switch(
    x: torch.Tensor,
    src: int,
    dst: int,
    group: Any,
    src_length: int | None = None,
    src_sizes: list[int] | None = None,
    dst_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Sharded on axis ``src`` → sharded on axis ``dst`` with one ``all_to_all_single``.

    Shape ``[.., a_r, .., L_dst, ..]`` → ``[.., L_src, .., b_r, ..]`` where ``a_r`` and ``b_r``
    are this rank's balanced shards of the global ``src_length`` and of ``L_dst``. Each rank
    sends ``(local elements)·(N−1)/N`` when lengths divide evenly. Backward is the reverse
    switch. If ``src_length`` is omitted it is the sum of the shards (then balanced).
    ``src_sizes`` / ``dst_sizes`` (rows per rank, in rank order) replace the balanced split of
    the source / destination dim when the sharding is some other contiguous partition.

    Before the exchange the ranks agree on the arguments (:mod:`.agreement`, one tiny
    all-gather, skipped inside the runtime's agreed forward): a wrong shard, dtype, device, whole-axis size or length on any rank raises
    the same :class:`~.agreement.CollectiveInputError` on every rank of ``group``.
    """
    if group_size(group) == 1:
        return x
    return _start(
        x, src, dst, group, src_length, async_op=False, src_sizes=src_sizes, dst_sizes=dst_sizes
    ).wait()


def switch_async(
    x: torch.Tensor, src: int, dst: int, group: Any, src_length: int | None = None
) -> SwitchHandle:
    """Start a :func:`switch` and return a :class:`SwitchHandle` at once.

    Compute that does not depend on the result can run before ``handle.wait()``; the forward
    exchange overlaps it. The backward exchange is synchronous (the same as :func:`switch`'s).
    Do not modify ``x`` in place before ``wait``. Arguments are agreed on like :func:`switch`'s.
    """
    if group_size(group) == 1:
        handle = SwitchHandle(None, group, current_region())
        handle._result = x
        return handle
    return _start(x, src, dst, group, src_length, async_op=True)

"""Point-to-point ring exchange: every rank sends to ``rank + shift`` and receives from ``rank − shift``.

``ring_exchange`` is the autograd primitive (its backward is the exchange with the opposite
shift, which routes each gradient back to the rank that sent the value). :class:`RingTransfer`
is the non-autograd building block of ring attention: several tensors in one
``batch_isend_irecv``, started early and waited later so that compute overlaps the transfer.

Receive shapes may differ per rank (uneven shards); the receiver names them (``recv_shape``),
since it knows the sender's shard size from the layout. Tensors with no elements are not put on
the wire (sender and receiver agree on that from the shapes). Ranks are group-local; peers are
mapped to global ranks with ``dist.get_global_rank``. Each transfer is traced as ``"p2p"`` with
the bytes this rank *sends*. Between the processes of one host on gloo the tensors go through
the group's shared-memory channel (:mod:`.shm`), as switches do; the setting that picks that
path is compared by every agreement (:func:`~.agreement.agree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..trace import current_region
from .agreement import Signature, agree, guard, ranks_text
from .group import group_rank, group_size, record
from .shm import start_exchange, transfer_channel


def _peers(group: Any, shift: int) -> tuple[int, int]:
    """Global ranks of ``(destination, source)`` for a ring shift inside ``group``."""
    n, r = group_size(group), group_rank(group)
    dst, src = (r + shift) % n, (r - shift) % n
    if group is None or group is dist.group.WORLD:
        return dst, src
    return dist.get_global_rank(group, dst), dist.get_global_rank(group, src)


class RingTransfer:
    """Send ``tensors`` to ``rank + shift`` and receive tensors of ``recv_shapes`` from ``rank − shift``.

    The transfer starts at construction; :meth:`wait` returns the received tensors. No
    autograd. ``tensors`` must stay unmodified until :meth:`wait`. ``dtypes`` defaults to the
    sent tensors' dtypes (position by position). Traced as one ``"p2p"`` record per tensor.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: Any,
        recv_shapes: Sequence[Sequence[int]],
        shift: int = 1,
        phase: str = "forward",
        region: str | None = None,
        tag: int = 0,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        if len(tensors) != len(recv_shapes):
            raise ValueError(f"{len(tensors)} tensors to send but {len(recv_shapes)} recv shapes")
        dtypes = [t.dtype for t in tensors] if dtypes is None else list(dtypes)
        self._send = [t.contiguous() for t in tensors]
        self.received = [
            torch.empty(tuple(s), dtype=dt, device=t.device)
            for s, dt, t in zip(recv_shapes, dtypes, tensors)
        ]
        self._works: list[Any] = []
        self._where = (group, region, phase)
        if group_size(group) == 1 or shift % group_size(group) == 0:
            for buf, t in zip(self.received, self._send):
                if buf.shape != t.shape:
                    raise ValueError(f"shift 0: recv shape {tuple(buf.shape)} != {tuple(t.shape)}")
                buf.copy_(t)
            return
        channel = transfer_channel(group, self.received[0].device) if self.received else None
        if channel is not None:
            for t in self._send:
                record("p2p", t.numel() * t.element_size(), group, t, phase, region)
            n, r = group_size(group), group_rank(group)
            sends = [((r + shift) % n, t) for t in self._send]
            receives = [((r - shift) % n, t) for t in self.received]
            with guard(f"ring transfer ({phase})", group, region):
                self._works = [start_exchange(channel, sends, receives, "ring transfer")]
            return
        dst, src = _peers(group, shift)
        ops = []
        for i, t in enumerate(self._send):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, dst, group, tag=tag + i))
            record("p2p", t.numel() * t.element_size(), group, t, phase, region)
        for i, buf in enumerate(self.received):
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, src, group, tag=tag + i))
        if ops:
            with guard(f"ring transfer ({phase})", group, region):
                self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Block until the transfer is complete; the received tensors."""
        group, region, phase = self._where
        with guard(f"ring transfer ({phase})", group, region):
            for w in self._works:
                w.wait()
        self._works = []
        self._send = []
        return self.received


def ring_exchange(
    x: torch.Tensor, group: Any, shift: int = 1, recv_shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Send ``x`` to group rank ``rank + shift``, return what ``rank − shift`` sent (mod N).

    ``recv_shape`` is the shape of the tensor arriving (default: ``x``'s shape; pass it when
    shards are uneven). Backward sends the gradient back with ``−shift``. Traced as ``"p2p"``
    with ``x``'s bytes, forward and backward. Once differentiable.

    The ranks agree first (one tiny all-gather): every rank raises the same error if any
    rank's ``shift``, dtype or device differs, or a ``recv_shape`` is not the shape its sender
    holds.
    """
    recv_shape = tuple(x.shape) if recv_shape is None else tuple(int(s) for s in recv_shape)
    n = group_size(group)
    if n > 1:
        sig = Signature("ring_exchange").arg("shift", int(shift) % n).tensor("x", x, range(x.dim()))
        sig.local("shape", x.shape).local("recv_shape", recv_shape)
        agreed = agree(sig, group, x.device)
        shapes, wanted = agreed.local("shape"), agreed.local("recv_shape")
        bad = [r for r in range(n) if wanted[r] != shapes[(r - shift) % n]]
        if bad:
            agreed.fail(
                f"recv_shape is not the shape its sender holds on {ranks_text(bad)}: "
                + "; ".join(
                    f"rank {r} expects {wanted[r]}, rank {(r - shift) % n} sends "
                    f"{shapes[(r - shift) % n]}"
                    for r in bad
                )
            )
    return _RingExchange.apply(x, group, int(shift), recv_shape, current_region())


class _RingExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, shift: int, recv_shape: tuple, region: str
    ) -> torch.Tensor:
        ctx.group, ctx.shift, ctx.shape, ctx.region = group, shift, tuple(x.shape), region
        return RingTransfer([x], group, [recv_shape], shift, "forward", region).wait()[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        t = RingTransfer([grad], ctx.group, [ctx.shape], -ctx.shift, "backward", ctx.region)
        return t.wait()[0], None, None, None, None

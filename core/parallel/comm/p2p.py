"""Point-to-point ring exchange: every rank sends to ``rank + shift`` and receives from ``rank − shift``.

``ring_exchange`` is the autograd primitive (its backward is the exchange with the opposite
shift, which routes each gradient back to the rank that sent the value). :class:`RingTransfer`
is the non-autograd building block of ring attention: several tensors in one
``batch_isend_irecv``, started early and waited later so that compute overlaps the transfer.
:class:`PeerTransfer`, which it specialises, sends to and receives from any ranks (the balanced
ring's schedule).

Receive shapes may differ per rank (uneven shards); the receiver names them (``recv_shape``),
since it knows the sender's shard size from the layout. Tensors with no elements are not put on
the wire (sender and receiver agree on that from the shapes). Ranks are group-local; peers are
mapped to global ranks with ``dist.get_global_rank``. Each transfer is traced as ``"p2p"`` with
the bytes this rank *sends*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..trace import current_region
from .agreement import Signature, agree, guard, ranks_text, skips_agreement
from .group import group_rank, group_size, record


def _global(group: Any, rank: int) -> int:
    """The global rank of group rank ``rank``."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


class PeerTransfer:
    """Send tensors to some ranks of ``group`` and receive tensors from others, all at once.

    ``sends``: ``(group rank, tensor)`` pairs; ``receives``: ``(group rank, shape, dtype)``
    triples, received on ``device``. A send to this rank itself is copied into this rank's
    receives from itself, in order. The transfer starts at construction; :meth:`wait` returns
    the received tensors in the order of ``receives``. No autograd; sent tensors must stay
    unmodified until :meth:`wait`. Traced as one ``"p2p"`` record per tensor sent to another
    rank.

    One ``batch_isend_irecv``. Between two ranks messages are matched in order: the sender
    lists what it sends to a peer in the order the peer lists what it receives from it (shapes
    and dtypes alike), and transfers in flight together between the same two ranks are started
    in the same order on both; tensor ``i`` of a peer's list travels with tag ``tag + i``.
    ``what`` names the transfer in a timeout's or a failed peer's error.
    """

    def __init__(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        receives: Sequence[tuple[int, Sequence[int], torch.dtype]],
        group: Any,
        device: torch.device | str,
        phase: str = "forward",
        region: str | None = None,
        tag: int = 0,
        what: str = "ring transfer",
    ) -> None:
        n, r = group_size(group), group_rank(group)
        self.received = [
            torch.empty(tuple(shape), dtype=dt, device=device) for _, shape, dt in receives
        ]
        self._works: list[Any] = []
        self._where = (group, region, phase)
        self._what = what
        own = [t for peer, t in sends if peer % n == r]
        own_bufs = [b for (peer, _, _), b in zip(receives, self.received) if peer % n == r]
        if len(own) != len(own_bufs):
            raise ValueError(f"{len(own)} tensors sent to this rank but {len(own_bufs)} received")
        for buf, t in zip(own_bufs, own):
            if buf.shape != t.shape:
                raise ValueError(f"to itself: recv shape {tuple(buf.shape)} != {tuple(t.shape)}")
            buf.copy_(t)
        out = [(peer % n, t.contiguous()) for peer, t in sends if peer % n != r]
        into = [(peer % n, b) for (peer, _, _), b in zip(receives, self.received) if peer % n != r]
        self._send = [t for _, t in out]  # kept alive until wait()
        if n == 1:
            return
        for _, t in out:
            record("p2p", t.numel() * t.element_size(), group, t, phase, region)
        ops = []
        for where, pairs in ((dist.isend, out), (dist.irecv, into)):
            index: dict[int, int] = {}
            for peer, t in pairs:
                i = index[peer] = index.get(peer, -1) + 1
                if t.numel():
                    ops.append(dist.P2POp(where, t, _global(group, peer), group, tag=tag + i))
        if ops:
            with guard(f"{what} ({phase})", group, region):
                self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """Block until the transfer is complete; the received tensors."""
        group, region, phase = self._where
        with guard(f"{self._what} ({phase})", group, region):
            for w in self._works:
                w.wait()
        self._works = []
        self._send = []
        return self.received


class RingTransfer(PeerTransfer):
    """Send ``tensors`` to ``rank + shift`` and receive tensors of ``recv_shapes`` from ``rank − shift``.

    A :class:`PeerTransfer` of one peer each way. ``dtypes`` defaults to the sent tensors'
    dtypes (position by position).
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
        n, r = group_size(group), group_rank(group)
        if n == 1 or shift % n == 0:  # to itself: a copy, nothing on the wire or traced
            self._works, self._send, self._where = [], [], (group, region, phase)
            self._what = "ring transfer"
            self.received = []
            for s, dt, t in zip(recv_shapes, dtypes, tensors):
                if tuple(s) != tuple(t.shape):
                    raise ValueError(f"shift 0: recv shape {tuple(s)} != {tuple(t.shape)}")
                self.received.append(t.to(dtype=dt, copy=True))
            return
        device = tensors[0].device if tensors else "cpu"
        super().__init__(
            [((r + shift) % n, t) for t in tensors],
            [((r - shift) % n, s, dt) for s, dt in zip(recv_shapes, dtypes)],
            group,
            device,
            phase,
            region,
            tag,
        )


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
    if n > 1 and not skips_agreement(group):  # the runtime's calls were agreed at its entry
        sig = Signature("ring_exchange").arg("shift", int(shift) % n).tensor("x", x, range(x.dim()))
        sig.local("shape", x.shape).local("recv_shape", recv_shape)
        agreed = agree(sig, group, x.device, needs_rows=True)
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

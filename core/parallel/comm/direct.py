"""A switch sent straight from the input and received straight into the result (gloo, CPU).

``all_to_all_single`` needs the blocks for each rank laid end to end, so a switch whose blocks
are strided in the input (``[1, T/N, S, C]`` sharded on ``t`` → on ``s``: the block for rank
``q`` is ``T/N`` separate runs of ``S/N·C`` elements) packs them with one copy first. On gloo
a point-to-point message can be sent from, and received into, any contiguous run, so when a
block is a few long runs in the input and lands as a few long runs in the result, the switch
can send each run as one message and skip the pack copy (and, on the receive side, the unpack
copy the all-to-all needs when the leading axes are not trivial). Only the rank's own block is
copied, while the messages travel.

Both sides cut the block from ``p`` to ``q`` — shape ``B`` = the global shape with
``src_sizes[p]`` rows on ``src`` and ``dst_sizes[q]`` on ``dst`` — the same way: one message per
index of ``B``'s axes before ``max(src, dst)``, in row-major order. Every such message is one
contiguous run on the sender (its input is contiguous and only cut on ``dst``) and on the
receiver (the result is contiguous and only cut on ``src``). Empty blocks send nothing.

Each message costs gloo a rendezvous (tens of µs on this machine), so the path pays only for
long runs: :func:`direct_plan` takes it when every message is at least
``SETTINGS.direct_min_bytes`` and there are at most ``SETTINGS.direct_max_messages`` per peer
(``docs/comm.md`` has the measurements). The decision depends on what every rank of the group
agreed on (the global shape, the split sizes, the dtype, the backend) and on those two
settings, which every agreement compares across the ranks too (:func:`~.agreement.agree`:
they must be equal on every rank; a rank with other settings gets a
:class:`~.agreement.CollectiveInputError` naming them), so the whole group takes the same path. A non-contiguous input is made
contiguous first (one copy: then only the unpack copy is saved).

Messages are matched by gloo in posting order per (peer, tag): every rank posts its receives
and sends in the same program order, the status words under tag :data:`STATUS_TAG` and the data
under :data:`DATA_TAG` (two tags reserved for this module), so switches in flight together
(``switch_async``) and ring transfers on the same group (other tags) cannot cross.

A folded (rehearsed) switch on this path sends its status word as one more small message per
peer (:func:`exchange_direct`), posted before the data, so a rank's miss is seen by every rank
as in :mod:`.folded`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .blocks import offsets, result_tensor
from .settings import SETTINGS

if TYPE_CHECKING:
    from .exchange import _SwitchMeta

STATUS_TAG, DATA_TAG = 0x5D00, 0x5D01  # the point-to-point tags of a direct switch
_EXCHANGES = [0]  # direct exchanges started by this process


def exchanges_started() -> int:
    """How many direct exchanges this process has started (benchmarks and tests check it)."""
    return _EXCHANGES[0]


@dataclass(frozen=True)
class DirectPlan:
    """How one rank's switch is cut into messages (the same cut on every rank).

    ``meta`` is the rank's switch layout; ``depth`` = ``max(src, dst)`` (≥ 1: the two differ).
    A block of shape ``B`` travels as ``prod(B[:depth])`` messages of shape ``B[depth:]``.
    """

    meta: _SwitchMeta
    depth: int

    def _pieces(self, t: torch.Tensor, axis: int, start: int, rows: int) -> list[torch.Tensor]:
        """The contiguous runs of ``t.narrow(axis, start, rows)`` (shape ``B``): one view of
        shape ``B[depth:]`` per index of ``B[:depth]``, in row-major order; none if empty."""
        block = t.narrow(axis, start, rows)
        if block.numel() == 0:
            return []
        lead = [range(s) for s in block.shape[: self.depth]]
        return [block[index] for index in itertools.product(*lead)]

    def send_pieces(self, x: torch.Tensor, q: int) -> list[torch.Tensor]:
        """The messages for rank ``q``: views of the contiguous input ``x`` (``meta.x_shape``)."""
        meta = self.meta
        return self._pieces(x, meta.dst, offsets(meta.dst_sizes)[q], meta.dst_sizes[q])

    def recv_pieces(self, y: torch.Tensor, p: int) -> list[torch.Tensor]:
        """Where the messages from rank ``p`` land: views of the contiguous result ``y``
        (``meta.y_shape``)."""
        meta = self.meta
        return self._pieces(y, meta.src, offsets(meta.src_sizes)[p], meta.src_sizes[p])


def direct_plan(meta: _SwitchMeta, x: torch.Tensor, group: Any) -> DirectPlan | None:
    """The direct plan of a switch, or ``None`` when the packed all-to-all is the better path.

    Direct only on gloo and the CPU (and not when ``SETTINGS.direct_min_bytes`` is ``None``),
    with every message of at least ``SETTINGS.direct_min_bytes`` and at most
    ``SETTINGS.direct_max_messages`` per peer, or when no block crosses ranks at all (then it
    sends nothing). Reads only the group's agreed sizes and the settings (equal on every rank),
    so every rank decides alike; O(N).
    """
    if x.device.type != "cpu" or SETTINGS.direct_min_bytes is None:
        return None
    src, dst, depth = meta.src, meta.dst, max(meta.src, meta.dst)
    shape = list(meta.x_shape)
    shape[src] = sum(meta.src_sizes)
    # a block p → q has src_sizes[p] rows on src and dst_sizes[q] on dst; the deeper of the two
    # axes sets the message length, the other the message count
    after = math.prod(s for i, s in enumerate(shape) if i > depth)
    before = math.prod(s for i, s in enumerate(shape) if i < depth and i not in (src, dst))
    deep, shallow = (
        (meta.src_sizes, meta.dst_sizes) if src == depth else (meta.dst_sizes, meta.src_sizes)
    )
    if after * before == 0 or not _crosses(meta.src_sizes, meta.dst_sizes):
        return DirectPlan(meta=meta, depth=depth)  # no message at all beats an empty all-to-all
    smallest = min(s for s in deep if s) * after * x.element_size()
    most = max(shallow) * before
    if most > SETTINGS.direct_max_messages or smallest < SETTINGS.direct_min_bytes:
        return None
    if dist.get_backend(group) != "gloo":
        return None
    return DirectPlan(meta=meta, depth=depth)


def _crosses(src_sizes: list[int], dst_sizes: list[int]) -> bool:
    """Whether some rank ``p`` holds rows for another rank ``q ≠ p`` (a block crosses ranks)."""
    senders = [p for p, rows in enumerate(src_sizes) if rows]
    receivers = [q for q, rows in enumerate(dst_sizes) if rows]
    if not senders or not receivers:
        return False
    return not (len(senders) == len(receivers) == 1 and senders == receivers)


class DirectWork:
    """The messages of one direct exchange in flight; :meth:`wait` finishes them all.

    Dropped unfinished (an async switch whose handle was never waited, e.g. after an error),
    it still waits for its messages: gloo leaves the connection to a peer unusable when a
    point-to-point work is destroyed before its transfer completes, and the group's next
    collective would time out.
    """

    def __init__(self, works: list[Any], statuses: torch.Tensor | None = None) -> None:
        self.works, self.statuses = works, statuses  # the works hold the tensors they send

    def wait(self) -> None:
        while self.works:
            self.works[0].wait()
            self.works.pop(0)

    def __del__(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - a lost peer: the next collective reports it
            self.works = []


def exchange_direct(
    x: torch.Tensor | None,
    plan: DirectPlan,
    like: torch.Tensor,
    group: Any,
    status: int | None = None,
) -> tuple[torch.Tensor, DirectWork]:
    """Start one direct switch exchange; ``(result, work)`` — the result (``meta.y_shape``) is
    complete after ``work.wait()``.

    ``x`` is the contiguous input (``meta.x_shape``), or ``None`` on a rank that missed a folded
    call's prediction (it sends zeros of the predicted sizes and gets no usable result). With
    ``status`` (a folded call) every rank also sends that word to every peer first;
    ``work.statuses`` (``[N]`` int64) then holds the words received (this rank's own at its
    index) once the work is waited on.
    """
    meta = plan.meta
    n, r = len(meta.src_sizes), meta.rank
    _EXCHANGES[0] += 1
    y = result_tensor(meta.y_shape, like, group)
    works: list[Any] = []
    # global ranks of the peers (isend/irecv take them on every torch the package supports)
    world = group is None or group is dist.group.WORLD
    peers = [p if world else dist.get_global_rank(group, p) for p in range(n)]
    statuses = None
    if status is not None:
        statuses = torch.full((n,), status, dtype=torch.int64)
        word = torch.full((1,), status, dtype=torch.int64)
        for p in range(n):
            if p != r:
                works.append(dist.irecv(statuses[p : p + 1], peers[p], group, tag=STATUS_TAG))
                works.append(dist.isend(word, peers[p], group, tag=STATUS_TAG))
    # a rank that missed sends zeros, cut like the predicted input (a meta tensor gives the cut)
    source = x if x is not None else torch.empty(meta.x_shape, dtype=like.dtype, device="meta")
    zeros = None
    for p in range(n):
        if p == r:
            continue
        for piece in plan.recv_pieces(y, p):
            works.append(dist.irecv(piece, peers[p], group, tag=DATA_TAG))
        for piece in plan.send_pieces(source, p):
            if x is None:
                if zeros is None or zeros.numel() < piece.numel():
                    zeros = torch.zeros(piece.numel(), dtype=like.dtype, device=like.device)
                piece = zeros[: piece.numel()]
            works.append(dist.isend(piece, peers[p], group, tag=DATA_TAG))
    if x is not None:  # own block into place while the messages travel
        own = x.narrow(meta.dst, offsets(meta.dst_sizes)[r], meta.dst_sizes[r])
        y.narrow(meta.src, offsets(meta.src_sizes)[r], meta.src_sizes[r]).copy_(own)
    return y, DirectWork(works, statuses)

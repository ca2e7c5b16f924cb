"""A switch between processes of one host through shared memory (gloo groups, CPU tensors).

On gloo every byte of an all-to-all goes through a loopback TCP socket even when all ranks
share one machine: the kernel copies it into the socket and out again, with a system call and a
rendezvous per message, and the switch packs its strided blocks into a send buffer first. Here
each rank of a group instead owns one shared-memory mailbox (a file in ``/dev/shm``, mapped by
every rank of the group and unlinked at once, so nothing is left behind even after a crash):

* the sender copies its block for rank ``q`` straight from the input (any strides) into its
  slot for ``q`` and then raises a counter; that copy *is* the pack, there is no other;
* the receiver waits for the counter, copies the slot straight into its place in the result
  (any strides) and raises its own counter, which frees the slot for the sender's next chunk.

So a remote byte is copied twice in user space (what the socket's kernel copies cost), with no
pack copy and no system call. Each pair of ranks has :data:`SLOTS` slots of
``SETTINGS.shm_slot_bytes``; a longer block travels as a stream of chunks through them, every
chunk a contiguous run of rows of the block (:func:`chunk_cuts`, the same cut on both sides).
Every pair exchanges at least one chunk per switch (an empty one when the block is empty), whose
header carries the sender's status word: a folded (rehearsed) switch's miss reaches every rank
as in :mod:`.folded`.

Progress: chunks go out and come in strictly in order per pair of ranks (the ranks issue
their switches in the same program order). A rank makes progress only inside :meth:`ShmWork.wait`
(and one pass when a switch is launched); while it waits it also takes what its peers sent, so
two ranks whose slots are full never wait on each other. An asynchronous switch dropped
unwaited stays queued and is finished by the group's next wait.

The same channel carries the group's ring transfers, all-gathers and reduce-scatters
(:func:`start_exchange`): chunks of every kind share the queue of their pair of ranks.

The channel is set up by the group's first collective that may take this path: every rank
reports its host, whether it can map ``/dev/shm`` and whether it runs on x86-64 (whose stores
become visible to other cores in program order, which the counters rely on), and the slot it
can afford (the setting, at most what keeps the group's mailboxes within a quarter of the free
``/dev/shm``: a container's is often 64 MiB); every rank creates and maps its mailbox (the
smallest slot offered) and checks it sees every peer's; the group uses the path only if every
step succeeded on every rank (two tiny all-reduces), else it keeps gloo.
A wait longer than the group's timeout raises :class:`~.agreement.CollectiveTimeoutError`.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import platform
import select
import socket
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..trace import current_region
from .agreement import CollectiveTimeoutError, group_timeout_s, guard
from .blocks import offsets, result_tensor
from .group import group_rank, group_size
from .settings import SETTINGS

if TYPE_CHECKING:
    from .exchange import _SwitchMeta

SLOTS = 2  # chunks in flight per ordered pair of ranks
_LINE = 8  # int64 words per cache line: counters written by different ranks never share one
_BROKEN = 1  # the header word a rank sets when it gives up on the channel
_DOZING = 2  # the header word a rank sets while it sleeps on its doorbell
_PAGE = 4096
_SHM_DIR = "/dev/shm"
_MAX_CHANNELS = 16  # groups with a mailbox per process; more groups keep the all-to-all
_MIN_SLOT = 64 << 10  # a /dev/shm too full for slots this long keeps the all-to-all
_EXCHANGES = [0]  # shared-memory exchanges started by this process


def exchanges_started() -> int:
    """How many shared-memory exchanges this process has started (tests and benchmarks)."""
    return _EXCHANGES[0]


# --------------------------------------------------------------------------------------------
# the chunks of one block


Cut = tuple[tuple[int, ...], int, int]  # (index of the leading axes, first row, rows) on axis a


def chunk_cuts(shape: list[int] | torch.Size, itemsize: int, slot_bytes: int) -> list[Cut]:
    """How a block of ``shape`` travels through slots of ``slot_bytes``: its chunks, in order.

    The chunk axis ``a`` is the first axis whose trailing axes fit a slot; each chunk is
    ``block[lead].narrow(0, start, rows)`` for one index ``lead`` of the axes before ``a`` — a
    contiguous run of the block's rows, at most a slot long. An empty block is one empty chunk.
    """
    shape = list(shape)
    if math.prod(shape) == 0:
        return [((), 0, 0)]
    per_slot = max(slot_bytes // itemsize, 1)
    axis = next(a for a in range(len(shape)) if math.prod(shape[a + 1 :]) <= per_slot)
    rows = max(per_slot // math.prod(shape[axis + 1 :]), 1)
    return [
        (lead, start, min(rows, shape[axis] - start))
        for lead in itertools.product(*(range(s) for s in shape[:axis]))
        for start in range(0, shape[axis], rows)
    ]


def chunk_view(block: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The chunk ``cut`` of ``block`` (a view)."""
    lead, start, rows = cut
    return block[lead].narrow(0, start, rows)


# --------------------------------------------------------------------------------------------
# the mailboxes of one group


class ShmChannel:
    """This rank's mailbox and its views of its peers' ones, for one group.

    A mailbox is ``[header | counters | data]`` (int64 words, one cache line each part): the
    header holds the setup nonce (word 0) and the broken word (word 1: nonzero once this rank
    gave up on the channel, after which every rank refuses it); for each peer ``q`` a line with
    the chunks sent to ``q`` so far, then per slot the chunk's status word, then per slot its
    byte count (the receiver checks it against its own cut); for each peer ``p`` a line with
    the chunks taken from ``p`` so far. Data: ``SLOTS`` slots of ``slot_bytes`` per peer.
    """

    def __init__(
        self,
        n: int,
        r: int,
        slot_bytes: int,
        timeout_s: float,
        boxes: list[Any],
        pids: list[int] | None = None,
    ):
        self.n, self.r, self.slot_bytes, self.timeout_s = n, r, slot_bytes, timeout_s
        self.pids = pids  # the peers' process ids, where they share this process's pid namespace
        # doorbells (set up by _set_up, which closes them with the channel): this rank's (a
        # FIFO's read end) and its peers' (write ends; None where one could not be opened: that
        # peer then sleeps its doze out); a dozing rank is woken by a peer that moves a chunk
        self.bell: int | None = None
        self.bells: list[int | None] = [None] * n
        self.woken = 0  # dozes this rank's doorbell ended before their timeout (tests)
        self._bell_fds: list[int] = []  # the descriptors above, closed once (here or at exit)
        weakref.finalize(self, _close_all, self._bell_fds)
        self.peers = [p for p in range(n) if p != r]
        self.words = [memoryview(box).cast("B").cast("q") for box in boxes]
        data_start = _counter_bytes(n)
        self.data = [torch.frombuffer(box, dtype=torch.uint8)[data_start:] for box in boxes]
        self.sent = [0] * n  # chunks this rank sent to q
        self.taken = [0] * n  # chunks this rank took from p
        self.outgoing: list[deque[_Chunk]] = [deque() for _ in range(n)]
        self.incoming: list[deque[_Chunk]] = [deque() for _ in range(n)]

    # counters: word offsets in a mailbox ------------------------------------------------
    @staticmethod
    def _sent_at(q: int) -> int:
        return _LINE * (1 + q)

    def _status_at(self, q: int, slot: int) -> int:
        return _LINE * (1 + q) + 1 + slot

    def _nbytes_at(self, q: int, slot: int) -> int:
        return _LINE * (1 + q) + 1 + SLOTS + slot

    def _taken_at(self, p: int) -> int:
        return _LINE * (1 + self.n + p)

    def _slot(self, owner: int, to: int, slot: int) -> torch.Tensor:
        """Slot ``slot`` of ``owner``'s mailbox for chunks to rank ``to``."""
        index = to if to < owner else to - 1
        start = (index * SLOTS + slot) * self.slot_bytes
        return self.data[owner][start : start + self.slot_bytes]

    # failures ---------------------------------------------------------------------------
    def check_usable(self, what: str) -> None:
        """Raise on every rank once any rank gave up on the channel (a timeout, an interrupted
        exchange, a stream out of step): its queues may hold another collective's chunks, so
        nothing may travel through it any more (a gloo connection is closed alike)."""
        broken = [p for p in range(self.n) if self.words[p][_BROKEN]]
        if broken:
            raise CollectiveTimeoutError(
                f"{self._about(what)}: the group's channel is broken since an earlier failure on rank(s) {broken} (a "
                "timeout or an interrupted collective); the group cannot communicate any more. "
                "Look for the first error in the ranks' logs and start again."
            )

    def _about(self, what: str) -> str:
        """``what`` with its comm region, the transport, the group and this rank: an error's
        opening words, as :func:`~.agreement.guard` writes them."""
        return (
            f"{what} (comm region '{current_region() or '-'}', shared memory, group of "
            f"{self.n} ranks, this is rank {self.r})"
        )

    def _give_up(self) -> None:
        self.words[self.r][_BROKEN] = 1

    # progress ---------------------------------------------------------------------------
    def _send_ready(self, q: int) -> bool:
        queue, words = self.outgoing[q], self.words[self.r]
        moved = False
        while queue:
            k = self.sent[q]
            if k - self.words[q][self._taken_at(self.r)] >= SLOTS:
                break  # q has not taken the chunk that last used this slot
            chunk = queue[0]
            slot = k % SLOTS
            if chunk.view is not None and chunk.nbytes:
                _as(self._slot(self.r, q, slot), chunk).copy_(chunk.view)
            words[self._status_at(q, slot)] = chunk.status
            words[self._nbytes_at(q, slot)] = chunk.nbytes
            words[self._sent_at(q)] = k + 1  # after the data: x86 keeps stores in order
            queue.popleft()
            self.sent[q] = k + 1
            chunk.work.pending -= 1
            moved = True
        return moved

    def _take_ready(self, p: int) -> bool:
        queue, theirs = self.incoming[p], self.words[p]
        moved = False
        while queue and theirs[self._sent_at(self.r)] > self.taken[p]:
            chunk = queue[0]
            k = self.taken[p]
            slot = k % SLOTS
            status, nbytes = (
                theirs[self._status_at(self.r, slot)],
                theirs[self._nbytes_at(self.r, slot)],
            )
            if nbytes != chunk.nbytes and status == 0:
                raise _OutOfStep(
                    f"rank {p} sent a chunk of {nbytes} bytes where rank {self.r} expected "
                    f"{chunk.nbytes}: the ranks' collectives are out of step (another program "
                    "order on some rank, or a receive shape other than the sender's)"
                )
            if status == 0 and chunk.view is not None and chunk.nbytes:
                chunk.view.copy_(_as(self._slot(p, self.r, slot), chunk))
            if status != 0 and chunk.work.statuses is not None:
                chunk.work.statuses[p] = status
            self.words[self.r][self._taken_at(p)] = k + 1  # the slot is free again
            queue.popleft()
            self.taken[p] = k + 1
            chunk.work.pending -= 1
            moved = True
        return moved

    def pump(self) -> bool:
        """One pass over every peer: send what fits, take what arrived. Whether anything moved.

        A peer this rank sent a chunk to, or freed a slot of, is woken if it dozes
        (:meth:`_ring`). Anything raised in between (a stream out of step, an interrupt)
        breaks the channel on every rank (:meth:`check_usable`) before it propagates."""
        moved = False
        try:
            for q in self.peers:
                if self._send_ready(q):
                    self._ring(q)
                    moved = True
            for p in self.peers:
                if self._take_ready(p):
                    self._ring(p)
                    moved = True
        except BaseException:
            self._give_up()
            raise
        return moved

    def _ring(self, q: int) -> None:
        """Wake ``q`` if it dozes on its doorbell (one byte into its FIFO; a full FIFO has
        been rung already, a gone reader is the liveness check's business)."""
        fd = self.bells[q]
        if fd is not None and self.words[q][_DOZING]:
            try:
                os.write(fd, b"\x01")
            except OSError:  # BlockingIOError (full: rung already), BrokenPipeError
                pass

    def _doze(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, woken early by a peer's :meth:`_ring`; whether a chunk
        moved meanwhile (a last pass after the dozing word is set, so a peer that moved a
        chunk before seeing it is not slept through).

        The dozing word and a peer's counter are written and read in opposite orders by the
        two ranks; x86 may let each rank's read pass its own write, so both may miss the
        other once: the timeout bounds that (the sleep the path had without a doorbell).
        """
        if self.bell is None or not SETTINGS.shm_doorbell:
            time.sleep(seconds)
            return False
        mine = self.words[self.r]
        mine[_DOZING] = 1
        try:
            if self.pump():
                return True
            try:
                if _readable(self.bell, seconds):
                    self.woken += 1
                os.read(self.bell, 4096)  # drain the rings
            except BlockingIOError:  # nothing rang
                pass
            except (OSError, ValueError):  # the doorbell failed: sleep from now on
                self.close_bells()
                time.sleep(seconds)
        finally:
            mine[_DOZING] = 0
        return False

    def close_bells(self) -> None:
        """Close this rank's doorbell and its ends of the peers' ones (it sleeps its dozes
        out from now on, and rings nobody)."""
        self.bell, self.bells = None, [None] * self.n
        _close_all(self._bell_fds)

    def progress(self, work: ShmWork) -> None:
        """Pump until ``work`` is complete (and every chunk queued before it).

        Idle, it polls 32 times, then yields its core between polls (a peer may need it when
        there are more ranks than cores); after 200 µs it dozes on its doorbell between polls
        (:meth:`_doze`: woken by the peer that moves a chunk for it, else after 50 µs up to
        1 ms). Every 100 ms of idling after the first second it checks that the peers are
        alive; a peer that broke the channel, died, or a wait beyond the group's timeout
        raises :class:`~.agreement.CollectiveTimeoutError` (and breaks the channel).
        """
        idle, since, nap, checked = 0, 0.0, 50e-6, 0.0
        while work.pending:
            if self.pump():
                idle, nap = 0, 50e-6
                continue
            idle += 1
            if idle < 32:
                continue
            now = time.monotonic()
            if idle == 32:
                since = checked = now
                continue
            waited = now - since
            if waited > 1.0 and now - checked > 0.1:
                checked = now
                self._check_peers(work.what)
            if waited > self.timeout_s:
                self._give_up()
                raise CollectiveTimeoutError(
                    f"{self._about(work.what)} waited {self.timeout_s:g} s for a peer: another rank did not reach this "
                    "collective (it raised, hung or took another path). Look for the first "
                    "error in the other ranks' logs; the timeout is the group's "
                    "(build_mesh(timeout_s=...) or DSPZOO_COLLECTIVE_TIMEOUT), and "
                    "DSPZOO_COMM_SHM_SLOT_KIB=off sends over gloo instead."
                )
            if waited < 200e-6:
                os.sched_yield()
            elif self._doze(nap):
                idle, nap = 0, 50e-6
            else:
                nap = min(nap * 2, 1e-3)

    def _check_peers(self, what: str) -> None:
        """Raise if a peer broke the channel or its process is gone."""
        try:
            self.check_usable(what)
            dead = [p for p in self.peers if self.pids and not _alive(self.pids[p])]
        except CollectiveTimeoutError:
            self._give_up()
            raise
        if dead:
            self._give_up()
            raise CollectiveTimeoutError(
                f"{self._about(what)}: the process of rank(s) {dead} is gone (pid {[self.pids[p] for p in dead]}); look "
                "for its error in its log."
            )


class _OutOfStep(CollectiveTimeoutError):
    """A chunk's byte count is not the one the receiver cut: the ranks' collectives differ."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent — a
    launcher's child that crashed — counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X", "x")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process of that pid: alive
            return True
        return True


def _as(slot: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """The first ``chunk.nbytes`` of a slot as a tensor of the chunk's dtype and shape."""
    return slot[: chunk.nbytes].view(chunk.dtype).view(chunk.shape)


def _counter_bytes(n: int) -> int:
    words = _LINE * (1 + 2 * n)
    return -(-words * 8 // _PAGE) * _PAGE


def _mailbox_bytes(n: int, slot_bytes: int) -> int:
    return _counter_bytes(n) + (n - 1) * SLOTS * slot_bytes


@dataclass
class _Chunk:
    work: ShmWork
    view: torch.Tensor | None  # the rows sent (sender) or their place in the result (receiver)
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    status: int = 0


class ShmWork:
    """The chunks of one shared-memory exchange in flight; :meth:`wait` finishes them.

    ``statuses`` (folded calls: ``[N]`` int64, this rank's own word at its index) holds every
    peer's status word once waited on. ``what`` names the collective in errors.
    """

    def __init__(self, channel: ShmChannel, statuses: torch.Tensor | None, what: str) -> None:
        self.channel, self.statuses, self.what, self.pending = channel, statuses, what, 0

    def wait(self) -> None:
        if self.pending:
            self.channel.progress(self)


# --------------------------------------------------------------------------------------------
# setting a group's channel up


_CHANNELS: dict[int, tuple[Any, ShmChannel | None]] = {}


def channel_for(group: Any) -> ShmChannel | None:
    """``group``'s channel, set up by its first call (a collective: every rank of the group
    must call this at the same point, as every switch does); ``None`` when some rank cannot
    share memory with the others (the group then keeps the all-to-all)."""
    key = id(group)
    entry = _CHANNELS.get(key)
    if entry is None or entry[0] is not group:
        with guard("shared-memory setup", group, current_region()):
            entry = (group, _set_up(group, _slot_capacity(SETTINGS.shm_slot_bytes)))
        _CHANNELS[key] = entry  # holding the group keeps its id from being reused
    return entry[1]


def transport(group: Any) -> str:
    """How ``group``'s collectives travel so far, in words (a report's line): ``"shared
    memory"`` once its channel is set up, else the backend's name (also before its first
    collective, and for one rank)."""
    entry = _CHANNELS.get(id(group))
    if entry is not None and entry[0] is group and entry[1] is not None:
        return "shared memory"
    return dist.get_backend(group) if group is not None and dist.is_initialized() else "none"


def _slot_capacity(slot_bytes: int | None) -> int:
    """A slot's bytes: the setting rounded down to whole cache lines (0: no channel)."""
    return (slot_bytes or 0) // 64 * 64


def chunk_bytes(channel: ShmChannel) -> int:
    """The longest chunk now: the setting (equal on every rank), at most the channel's slot."""
    return max(min(_slot_capacity(SETTINGS.shm_slot_bytes), channel.slot_bytes), 64)


def release_channels() -> None:
    """Forget every group's channel: its doorbells are closed now, its mailboxes unmapped
    once nothing views them (a rehearsed call's plan keeps its group's channel)."""
    for _, channel in _CHANNELS.values():
        if channel is not None:
            channel.close_bells()
    _CHANNELS.clear()


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _can_share() -> bool:
    machine = platform.machine().lower()
    return (
        machine in ("x86_64", "amd64")
        and os.path.isdir(_SHM_DIR)
        and os.access(_SHM_DIR, os.W_OK)
        and sum(channel is not None for _, channel in _CHANNELS.values()) < _MAX_CHANNELS
    )


def _fitting_slot(n: int) -> int:
    """The largest slot whose mailboxes, for every rank of an ``n``-rank group, take at most a
    quarter of what ``/dev/shm`` has free (a container's default is often 64 MiB in all)."""
    try:
        stat = os.statvfs(_SHM_DIR)
    except OSError:
        return 0
    free = stat.f_bavail * stat.f_frsize // 4 - n * _counter_bytes(n)
    return max(free // (n * max(n - 1, 1) * SLOTS), 0) // 64 * 64


def _all_ok(ok: bool, group: Any) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _set_up(group: Any, slot_bytes: int) -> ShmChannel | None:
    """Create, map and check the group's mailboxes on every rank together (see the module)."""
    n, r = group_size(group), group_rank(group)
    nonce = uuid.uuid4().int & (2**62 - 1)
    fitting = _fitting_slot(n) if _can_share() else 0
    can = slot_bytes > 0 and fitting >= min(slot_bytes, _MIN_SLOT)
    slot_bytes = min(slot_bytes, fitting)
    mine = (_host_key(), can, nonce, slot_bytes, os.getpid(), _pid_namespace())
    every: list[Any] = [None] * n
    dist.all_gather_object(every, mine, group=group)
    if len({host for host, *_ in every}) != 1 or not all(can for _, can, *_ in every):
        return None
    token = f"{every[0][2]:x}"
    slot_bytes = min(e[3] for e in every)
    # liveness checks by pid only where every rank sees the others' pids
    shared_pids = len({e[5] for e in every}) == 1 and every[0][5] is not None
    pids = [e[4] for e in every] if shared_pids else None

    def path(rank: int) -> str:
        return os.path.join(_SHM_DIR, f"dspzoo-{token}-{rank}")

    size = _mailbox_bytes(n, slot_bytes)
    boxes: list[Any] = [None] * n
    bell, bells = None, [None] * n
    try:
        try:
            boxes[r] = _create(path(r), size)
            memoryview(boxes[r]).cast("B").cast("q")[0] = every[r][2]
            created = True
        except OSError:
            created = False
        bell = _make_bell(path(r) + ".bell") if created else None
        if not _all_ok(created, group):
            return None
        try:
            for p in range(n):
                if p != r:
                    boxes[p] = _open(path(p), size)
                    if memoryview(boxes[p]).cast("B").cast("q")[0] != every[p][2]:
                        raise OSError(f"{path(p)} is not rank {p}'s mailbox")
                    bells[p] = _ring_end(path(p) + ".bell")
            seen = True
        except OSError:
            seen = False
        if not _all_ok(seen, group):
            return None
        channel = ShmChannel(n, r, slot_bytes, group_timeout_s(group) or 1800.0, boxes, pids)
        channel.bell, channel.bells = bell, bells
        channel._bell_fds.extend(fd for fd in (bell, *bells) if fd is not None)
        bell, bells = None, [None] * n  # the channel owns them now
        return channel
    finally:
        _close_all([fd for fd in (bell, *bells) if fd is not None])
        for name in (path(r), path(r) + ".bell"):
            try:  # every rank has mapped (or given up on) every mailbox: the names can go
                os.unlink(name)
            except OSError:
                pass


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _make_bell(path: str) -> int | None:
    """A doorbell: a FIFO at ``path``, opened for reading (and writing, so it never reports
    end-of-file), non-blocking; ``None`` where one cannot be made (the rank then sleeps its
    dozes out, as without a doorbell)."""
    try:
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None


def _ring_end(path: str) -> int | None:
    """This rank's end of a peer's doorbell at ``path``, or ``None``: opened for reading and
    writing (non-blocking), so the FIFO always has a reader and a ring into the doorbell of a
    peer that died fills its buffer (then ``BlockingIOError``) instead of raising SIGPIPE."""
    try:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return None


def _readable(fd: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``fd`` to be readable: ``select`` (microseconds) where the
    descriptor fits its set, else ``poll`` (no limit on descriptors; milliseconds)."""
    if fd < 1024:  # FD_SETSIZE
        return bool(select.select([fd], [], [], seconds)[0])
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(seconds * 1e3, 1.0)))


def _close_all(fds: list[int]) -> None:
    """Close ``fds`` and empty the list (so that nothing closes them twice)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _create(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # reserve the pages now: a full /dev/shm fails here
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _open(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} has the wrong size")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# the switch


def transfer_channel(group: Any, device: torch.device | str) -> ShmChannel | None:
    """The channel a collective on ``group`` sends through, or ``None`` (gloo then): CPU
    tensors, gloo, ``SETTINGS.shm_slot_bytes`` set (equal on every rank: every agreement
    compares it, :func:`~.agreement.agree`), and the group's channel set up (the first call
    on a group sets it up, a collective)."""
    if group is None or torch.device(device).type != "cpu" or SETTINGS.shm_slot_bytes is None:
        return None
    if dist.get_backend(group) != "gloo":
        return None
    return channel_for(group)


def _queue(
    work: ShmWork, t: torch.Tensor, peer: int, out: bool, most: int, status: int = 0
) -> None:
    """Queue ``t``'s chunks (at most ``most`` bytes each) to (``out``) or from ``peer``: on a
    sender ``t`` is the data (or a meta tensor of its shape, for status-only chunks), on a
    receiver where it lands."""
    itemsize, channel = t.element_size(), work.channel
    for cut in chunk_cuts(t.shape, itemsize, most):
        view = chunk_view(t, cut)
        data = None if view.device.type == "meta" or (out and status) else view
        chunk = _Chunk(work, data, view.numel() * itemsize, t.dtype, tuple(view.shape), status)
        (channel.outgoing if out else channel.incoming)[peer].append(chunk)
        work.pending += 1


def start_exchange(
    channel: ShmChannel,
    sends: list[tuple[int, torch.Tensor]],
    receives: list[tuple[int, torch.Tensor]],
    what: str,
) -> ShmWork:
    """Send each ``(group rank, tensor)`` of ``sends`` (any strides) and receive into each of
    ``receives`` (the sender's shape and dtype, any strides), in list order per peer — the
    order the peer lists them in; complete after ``work.wait()``."""
    channel.check_usable(what)
    _EXCHANGES[0] += 1
    work = ShmWork(channel, None, what)
    most = chunk_bytes(channel)  # the settings, agreed by the caller's agreement
    for peer, t in sends:
        _queue(work, t, peer, out=True, most=most)
    for peer, t in receives:
        _queue(work, t, peer, out=False, most=most)
    channel.pump()
    return work


def start_blocks(
    channel: ShmChannel,
    sends: list[torch.Tensor],
    receives: list[torch.Tensor | None],
    what: str,
) -> ShmWork:
    """Start an exchange of one block per rank: ``sends[q]`` to each peer ``q``, each peer
    ``p``'s block into ``receives[p]`` (lists indexed by group rank, any strides); this rank's
    own block is copied into ``receives[r]`` while the peers take theirs (unless ``None``:
    the caller keeps it where it is). Complete after ``work.wait()``."""
    r, peers = channel.r, channel.peers
    work = start_exchange(
        channel, [(q, sends[q]) for q in peers], [(p, receives[p]) for p in peers], what
    )
    if receives[r] is not None:
        receives[r].copy_(sends[r])
    return work


def sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``parts[0] + parts[1] + …`` added in rank order (the same order on every
    rank: a reduce-scatter through shared memory is deterministic)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    return out


class ShmReduceScatter:
    """A reduce-scatter through the channel, in flight: ``sends[q]`` (indexed by group rank,
    any strides; shaped like peer ``q``'s result) goes to each peer ``q``, each peer's block
    for this rank (shaped like ``out``) lands in a part of its own, and :meth:`total` sums
    every rank's block into ``out`` in rank order (:func:`sum_in_rank_order`: deterministic).
    This rank's own block is read from ``sends[r]`` in place, so ``out`` must not overlap it.

    Finished in two calls, the same for every caller: :meth:`wait` (the collective part,
    under the caller's ``guard``, which reports a backend error as a collective failure), then
    :meth:`total` (local arithmetic, outside it: its errors are not the peers')."""

    def __init__(self, channel: ShmChannel, sends: list[torch.Tensor], out: torch.Tensor) -> None:
        r = channel.r
        self.parts = [sends[r] if p == r else torch.empty_like(out) for p in range(channel.n)]
        self.out = out
        receives = [None if p == r else self.parts[p] for p in range(channel.n)]
        self.work = start_blocks(channel, sends, receives, "reduce_scatter")

    def wait(self) -> None:
        """Complete the exchange (every peer's block has arrived)."""
        self.work.wait()

    def total(self) -> torch.Tensor:
        """``out``, the rank-order sum of the parts (after :meth:`wait`)."""
        return sum_in_rank_order(self.parts, self.out)


@dataclass(frozen=True)
class ShmPlan:
    """One rank's switch on the shared-memory path: its layout, its group's channel and its
    chunk length, fixed when the plan is made from the agreed settings (a rehearsed call's
    plan cuts alike on every rank even if one rank's settings changed since: that rank then
    misses and the full agreement names the setting)."""

    meta: _SwitchMeta
    channel: ShmChannel
    chunk_bytes: int


def shm_plan(meta: _SwitchMeta, x: torch.Tensor, group: Any) -> ShmPlan | None:
    """The shared-memory plan of a switch, or ``None`` (then the direct or packed path).

    Only for CPU tensors on gloo with ``SETTINGS.shm_slot_bytes`` set (equal on every rank:
    every agreement compares it), and only if the group's channel could be set up.
    The first call on a group sets its channel up, a collective: every rank reaches it at the
    same switch because everything read before it is agreed.
    """
    if x.device.type != "cpu" or SETTINGS.shm_slot_bytes is None:
        return None
    if dist.get_backend(group) != "gloo":
        return None
    channel = channel_for(group)
    return None if channel is None else ShmPlan(meta, channel, chunk_bytes(channel))


def exchange_shm(
    x: torch.Tensor | None,
    plan: ShmPlan,
    like: torch.Tensor,
    group: Any,
    status: int | None = None,
) -> tuple[torch.Tensor, ShmWork]:
    """Start one shared-memory switch exchange; ``(result, work)`` — the result
    (``meta.y_shape``) is complete after ``work.wait()``.

    ``x`` is the input (``meta.x_shape``, any strides), or ``None`` on a rank that missed a
    folded call's prediction: it sends its status word in empty chunks and gets no usable
    result. With ``status`` (a folded call) ``work.statuses`` holds every rank's word.
    """
    meta, channel, most = plan.meta, plan.channel, plan.chunk_bytes
    n, r = len(meta.src_sizes), meta.rank
    channel.check_usable("switch")
    _EXCHANGES[0] += 1
    y = result_tensor(meta.y_shape, like, group)
    statuses = None if status is None else torch.full((n,), status, dtype=torch.int64)
    work = ShmWork(channel, statuses, "switch")
    source = x if x is not None else torch.empty(meta.x_shape, dtype=like.dtype, device="meta")
    dst_starts, src_starts = offsets(meta.dst_sizes), offsets(meta.src_sizes)
    word = status or 0
    for q in channel.peers:
        block = source.narrow(meta.dst, dst_starts[q], meta.dst_sizes[q])
        _queue(work, block, q, out=True, most=most, status=word)
    for p in channel.peers:
        block = y.narrow(meta.src, src_starts[p], meta.src_sizes[p])
        _queue(work, block, p, out=False, most=most)
    channel.pump()  # the first chunks go out now; the peers can take them while we copy
    if x is not None:  # own block into place
        own = x.narrow(meta.dst, dst_starts[r], meta.dst_sizes[r])
        y.narrow(meta.src, src_starts[r], meta.src_sizes[r]).copy_(own)
    return y, work

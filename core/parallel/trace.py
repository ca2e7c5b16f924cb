"""Communication and activation-memory accounting.

Every collective issued by :mod:`dspzoo.core.parallel.comm` reports to the active :class:`CommTracer`
(if any) how many bytes this rank sent to *other* ranks, tagged with the op kind, the phase
(forward/backward) and the named region that was open when the op was issued in the forward.

Bytes-sent conventions (per rank, payload only, self-traffic excluded):
    all-to-all (switch):      sum of the blocks addressed to other ranks
    all-gather (gather):      (N − 1) · local chunk (padded chunk when shards are uneven)
    reduce-scatter:           (N − 1) · output chunk (padded chunk when shards are uneven)
    all-reduce:               2 · (N − 1) / N · buffer (ring algorithm)

The cross-rank agreements (:mod:`dspzoo.core.parallel.comm.agreement`: once per forward at the
sharded region's entry, and before each direct call of a primitive) are control traffic: they
are recorded apart, as :class:`ControlRecord` s (:meth:`CommTracer.control_count`), never in the
payload totals.

:class:`SavedTensorMeter` counts activation memory exactly on any device: the bytes of the
distinct storages autograd saves for backward, parameters excluded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

_ACTIVE_TRACER: contextvars.ContextVar[CommTracer | None] = contextvars.ContextVar(
    "dspzoo_tracer", default=None
)
_REGION: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "dspzoo_region", default=()
)


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by this rank."""

    op: str
    phase: str
    region: str
    bytes_sent: int
    group_size: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ControlRecord:
    """One control exchange (an agreement) as seen by this rank."""

    what: str
    phase: str
    region: str
    bytes_sent: int
    group_size: int


@dataclass
class CommTracer:
    """Collects :class:`CommRecord` s (payload) and :class:`ControlRecord` s while active
    (see :func:`trace_comm`)."""

    records: list[CommRecord] = field(default_factory=list)
    control: list[ControlRecord] = field(default_factory=list)

    def record(self, record: CommRecord) -> None:
        self.records.append(record)

    def control_count(self, phase: str | None = None) -> int:
        """Number of control exchanges (agreements), optionally of one phase."""
        return sum(1 for c in self.control if phase is None or c.phase == phase)

    def control_bytes(self) -> int:
        """Bytes this rank sent in control exchanges."""
        return sum(c.bytes_sent for c in self.control)

    def total_bytes(
        self, op: str | None = None, phase: str | None = None, region_prefix: str = ""
    ) -> int:
        """Bytes sent by this rank, optionally filtered by op, phase and region prefix."""
        return sum(r.bytes_sent for r in self.filter(op, phase, region_prefix))

    def count(
        self, op: str | None = None, phase: str | None = None, region_prefix: str = ""
    ) -> int:
        """Number of collectives, with the same filters as :meth:`total_bytes`."""
        return len(self.filter(op, phase, region_prefix))

    def filter(
        self, op: str | None = None, phase: str | None = None, region_prefix: str = ""
    ) -> list[CommRecord]:
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and r.region.startswith(region_prefix)
        ]

    def summary(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """``{(region, op, phase): (count, bytes)}``."""
        out: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            entry = out[(r.region, r.op, r.phase)]
            entry[0] += 1
            entry[1] += r.bytes_sent
        return {k: (v[0], v[1]) for k, v in out.items()}

    def table(self, by_region: bool = True) -> str:
        """A printable table of counts and bytes per (region, op, phase)."""
        rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for (region, op, phase), (n, b) in self.summary().items():
            key = (region if by_region else "*", op, phase)
            rows[key][0] += n
            rows[key][1] += b
        lines = [f"{'region':<32} {'op':<16} {'phase':<9} {'count':>6} {'bytes/rank':>14}"]
        for (region, op, phase), (n, b) in sorted(rows.items()):
            lines.append(f"{region or '-':<32} {op:<16} {phase:<9} {n:>6} {format_bytes(b):>14}")
        lines.append(
            f"{'total':<32} {'':<16} {'':<9} {len(self.records):>6} {format_bytes(self.total_bytes()):>14}"
        )
        if self.control:
            groups = sorted({c.group_size for c in self.control})
            lines.append(
                f"{'control (agreements)':<32} {'all_gather':<16} {'':<9} "
                f"{len(self.control):>6} {format_bytes(self.control_bytes()):>14}"
                f"  (groups of {', '.join(map(str, groups))} ranks; not in the total)"
            )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """Human-readable byte count (KiB/MiB/GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@contextlib.contextmanager
def trace_comm() -> Iterator[CommTracer]:
    """Record every dspzoo collective issued inside the block (forward and backward)."""
    tracer = CommTracer()
    token = _ACTIVE_TRACER.set(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE_TRACER.reset(token)


@contextlib.contextmanager
def comm_region(name: str) -> Iterator[None]:
    """Tag collectives issued inside the block with ``name`` (regions nest with ``/``)."""
    token = _REGION.set((*_REGION.get(), name))
    try:
        yield
    finally:
        _REGION.reset(token)


def tag_stage(name: str | None, previous: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Tag what follows with region ``name`` until the next call, without a ``with`` block.

    For the one-line stages of plain-tensor blocks (:func:`dspzoo.core.parallel.context.stage`).
    ``previous`` is what the last call returned: while it is still the innermost tag it is
    replaced, otherwise ``name`` nests under the regions open now (an enclosing ``with
    comm_region`` that ended took the old tag with it). ``name=None`` only removes
    ``previous``. Returns the tag to pass to the next call.
    """
    now = _REGION.get()
    base = now[:-1] if previous is not None and now == previous else now
    tagged = None if name is None else (*base, name)
    if tagged is not None or base != now:
        _REGION.set(base if tagged is None else tagged)
    return tagged


def current_region() -> str:
    """The ``/``-joined names of the open regions."""
    return "/".join(_REGION.get())


def record_comm(
    op: str,
    bytes_sent: int,
    group_size: int,
    tensor: torch.Tensor,
    phase: str,
    region: str | None = None,
) -> None:
    """Report one collective to the active tracer (no-op when none is active)."""
    tracer = _ACTIVE_TRACER.get()
    if tracer is None:
        return
    tracer.record(
        CommRecord(
            op=op,
            phase=phase,
            region=current_region() if region is None else region,
            bytes_sent=int(bytes_sent),
            group_size=group_size,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).replace("torch.", ""),
        )
    )


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


def record_control(what: str, bytes_sent: int, group_size: int, region: str | None = None) -> None:
    """Report one control exchange (an agreement) to the active tracer (no-op when none is)."""
    tracer = _ACTIVE_TRACER.get()
    if tracer is None:
        return
    tracer.control.append(
        ControlRecord(
            what=what,
            phase="backward" if in_backward() else "forward",
            region=current_region() if region is None else region,
            bytes_sent=int(bytes_sent),
            group_size=group_size,
        )
    )


class SavedTensorMeter:
    """Exact activation memory: bytes of distinct storages saved for backward.

    Use as a context manager around a forward pass::

        with SavedTensorMeter(model.parameters()) as meter:
            loss = model(x).sum()
        print(meter.bytes)

    Storages that belong to ``exclude`` (usually the parameters) are not counted; a storage
    saved several times (e.g. as views) counts once.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: dict[tuple[int, str], int] = {}
        self._hooks: contextlib.AbstractContextManager | None = None

    @property
    def bytes(self) -> int:
        """Total bytes of the saved activation storages."""
        return sum(self._seen.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._excluded and tensor.device.type != "meta":
            self._seen[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple[int, str]:
    return (tensor.untyped_storage().data_ptr(), str(tensor.device))

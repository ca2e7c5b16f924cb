"""Agreement: a bad input on one rank raises the same error on every rank, agreed on the host.

A rank whose input is wrong (a shard of the wrong length, another dtype, another shape of the
whole axes, another global length) must not start a collective: the others would wait in it
until the process-group timeout, or the backend would abort on mismatched sizes. So the ranks
first exchange a :class:`Signature` of the call — a few ``int64`` words per rank (primitive,
dims, lengths, dtype, device, shapes with the sharded axis left out, this rank's shard sizes,
and whether this rank already found its own input invalid) — in one tiny all-gather on the
group's control side group, as CPU tensors (:func:`~.group.control_group`: gloo beside NCCL, the
group itself on gloo). Every rank then runs the same checks on the same words, so either every
rank goes on, or every rank raises the same :class:`CollectiveInputError` naming the rank(s)
that were wrong, the primitive and the comm region. A rank's own error message reaches the
others through one extra ``all_gather_object``, only on that error path.

**Once per forward.** The runtime agrees once, at the sharded region's entry
(:meth:`dspzoo.core.parallel.runtime.SeqParallel.agree_entry`: every rank's input check, the
inputs' shapes, dtypes and devices, the plan's identity), and runs its own calls after it as
trusted calls (:func:`trusted_calls`): every collective they make is a deterministic function
of what was agreed, so :func:`agree` exchanges nothing and only checks this rank's own words (a
failure there is a bug, raised on the rank that found it). Backward passes exchange nothing
either. Direct calls of the primitives (``split``, ``switch``,
``gather``, ``gather_for_local_use``, an attention method called by hand) agree each time;
debug mode (:func:`~.settings.set_debug`) agrees before every collective, backward included.

Agreements are control traffic: the tracer counts them apart from the payload
(:meth:`dspzoo.core.parallel.trace.CommTracer.control_count`).

Every collective call also runs under :func:`guard`: a ``RuntimeError`` from the backend (a
timeout, a peer that died) is re-raised as :class:`CollectiveTimeoutError` naming the
primitive, the region and the group's timeout (``build_mesh(timeout_s=...)`` /
``DSPZOO_COLLECTIVE_TIMEOUT``).
"""

from __future__ import annotations

import array
import contextlib
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..trace import current_region, in_backward, record_control
from .group import all_gather_single, control_group, group_rank, group_size
from .settings import SETTINGS

WIDTH = 64  # int64 words per rank in the agreement

# fmt: off
PRIMITIVES = (
    "split", "gather", "gather_for_local_use", "switch", "switch_async", "ring_exchange",
    "zigzag_split", "zigzag_gather", "ring_attention", "ulysses_attention", "lss_attention",
    "usp_attention", "check_consistent", "selective_scan", "ring_balanced", "entry", "validate",
)
_CODES = {name: 7_000 + i for i, name in enumerate(PRIMITIVES)}

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
# fmt: on
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta")
_DEVICE_CODES = {name: i for i, name in enumerate(_DEVICE_TYPES)}


class CollectiveInputError(UsageError):
    """A collective's input was wrong on some rank; raised identically on every rank of the group."""


class InputValidationError(CollectiveInputError):
    """Inputs rejected on one or more ranks of a group; raised on every rank of it."""


class CollectiveTimeoutError(RuntimeError):
    """A collective failed in the backend (timeout, lost peer); names the primitive and region."""


# --------------------------------------------------------------------------------------------
# the words of one call


def _words_of_list(values: Sequence[int]) -> tuple[str, list[int]]:
    """A short list travels as is; a long one as its length and a CRC."""
    values = [int(v) for v in values]
    if len(values) <= 8:
        return "list", values
    return "hash", [len(values), zlib.crc32(struct.pack(f"{len(values)}q", *values))]


class Signature:
    """What one rank passes to a collective, as words every rank can compare.

    ``same`` fields must be equal on every rank; ``free`` fields may differ (shard sizes,
    per-rank shapes) and are gathered for the caller's checks (:class:`Agreed`). ``error`` is a
    problem this rank found in its own input before the agreement. Fields are kept as flat
    word lists plus ``(name, kind, width)`` (kinds: "opt" (-1 = None), "float", "list",
    "hash", "dtype", "device", "shape"), read only to write an error message.
    """

    __slots__ = ("primitive", "same", "same_fields", "free", "free_fields", "error", "what")

    def __init__(self, primitive: str) -> None:
        self.primitive = primitive
        self.same: list[int] = []
        self.same_fields: list[tuple[str, str, int]] = []
        self.free: list[int] = []
        self.free_fields: list[tuple[str, str, int]] = []
        self.error: Exception | None = None
        self.what: str | None = None  # an input validation's subject ("STDiT inputs")

    def _add(self, name: str, kind: str, words: Sequence[int]) -> Signature:
        self.same += words
        self.same_fields.append((name, kind, len(words)))
        return self

    def arg(self, name: str, value: int | None) -> Signature:
        """An integer argument every rank must pass equally (``None`` allowed)."""
        return self._add(name, "opt", (-1 if value is None else int(value),))

    def number(self, name: str, value: float | None) -> Signature:
        """A float argument every rank must pass equally (compared bitwise)."""
        bits = -1 if value is None else struct.unpack("q", struct.pack("d", float(value)))[0]
        return self._add(name, "float", (bits,))

    def sizes(self, name: str, values: Sequence[int] | None) -> Signature:
        """A list argument (split sizes, sequence lengths) every rank must pass equally."""
        if values is None:
            return self._add(name, "opt", (-1,))
        kind, words = _words_of_list(values)
        return self._add(name, kind, words)

    def tensor(self, name: str, t: torch.Tensor, sharded: Sequence[int] = ()) -> Signature:
        """``t``'s dtype, device and shape must agree, except the sizes of the ``sharded`` axes."""
        dev = t.device.type
        self._add(f"{name}.dtype", "dtype", (_DTYPE_CODES.get(t.dtype, 99),))
        self._add(f"{name}.device", "device", (_DEVICE_CODES.get(dev, 99),))
        shape = [-1 if i in sharded else s for i, s in enumerate(t.shape)]
        return self._add(f"{name}.shape", "shape", (len(shape), *shape))

    def local(self, name: str, value: int | Sequence[int]) -> Signature:
        """A value that may differ per rank (this rank's shard size, its own shape)."""
        words = [int(value)] if isinstance(value, int) else [int(v) for v in value]
        self.free += words
        self.free_fields.append((name, "list", len(words)))
        return self

    def words(self, status: int) -> list[int]:
        out = [_CODES[self.primitive], status, len(self.same), len(self.free)]
        out += self.same
        out += self.free
        if len(out) > WIDTH:
            raise ValueError(f"{self.primitive}: too many arguments to agree on ({len(out)} words)")
        return out + [0] * (WIDTH - len(out))


def _format(kind: str, values: Sequence[int]) -> str:
    if kind == "opt":
        return "None" if values[0] == -1 else str(values[0])
    if kind == "dtype":
        return str(DTYPES[values[0]]).removeprefix("torch.") if values[0] < len(DTYPES) else "?"
    if kind == "device":
        return _DEVICE_TYPES[values[0]] if values[0] < len(_DEVICE_TYPES) else "?"
    if kind == "shape":
        return "(" + ", ".join("shard" if v == -1 else str(v) for v in values[1:]) + ")"
    if kind == "float":
        return (
            "None" if values[0] == -1 else repr(struct.unpack("d", struct.pack("q", values[0]))[0])
        )
    if kind == "hash":
        return f"<{values[0]} entries, crc {values[1]:#x}>"
    return str(list(values))


def ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# --------------------------------------------------------------------------------------------
# the outcome


class Agreed:
    """The gathered signatures of every rank; checks on them give the same verdict everywhere.

    ``rows`` is ``None`` for a trusted call (:func:`trusted_calls`): nothing was exchanged, and
    the checks see this rank's own words only.
    """

    def __init__(
        self, sig: Signature, rows: list[list[int]] | None, n: int, region: str, rank: int = 0
    ) -> None:
        self.sig, self.rows, self.n, self.region, self.rank = sig, rows, n, region, rank

    def fail(self, detail: str, primitive: str | None = None) -> NoReturn:
        """Raise the group's error (call it on every rank, from checks on gathered data).

        On a trusted call only the rank that found it raises (a bug: see :func:`trusted_calls`).
        """
        where = (
            "Raised on every rank of the group."
            if self.rows is not None
            else f"Found by rank {self.rank} alone, inside the runtime's agreed forward: the "
            "model's code differs between ranks, or this is a bug."
        )
        raise CollectiveInputError(
            f"{primitive or self.sig.primitive} (comm region '{self.region or '-'}', group of {self.n} "
            f"ranks): {detail}. {where}"
        )

    def _span(self, name: str) -> tuple[int, int]:
        """Where the ``free`` field ``name`` lies in ``sig.free``: ``(start, width)``."""
        start = 0
        for field_name, _, width in self.sig.free_fields:
            if field_name == name:
                return start, width
            start += width
        raise KeyError(name)

    def local(self, name: str) -> list[tuple[int, ...]]:
        """The ``free`` field ``name`` of every rank, in rank order (not on a trusted call:
        pass ``needs_rows`` to :func:`agree`)."""
        if self.rows is None:
            raise RuntimeError(f"{self.sig.primitive}: the other ranks' {name!r} was not exchanged")
        start, width = self._span(name)
        start += 4 + len(self.sig.same)  # after the header words and the ``same`` fields
        return [tuple(row[start : start + width]) for row in self.rows]

    def check_rows(self, name: str, want: Sequence[int], how: str) -> None:
        """Fail unless rank ``q``'s local ``name`` is ``want[q]`` for every ``q``.

        ``how`` says where ``want`` comes from, e.g. "a global length of 8 over 2 ranks".
        """
        if self.rows is None:  # trusted: this rank's own row
            mine = self.sig.free[self._span(name)[0]]
            if mine != want[self.rank]:
                self.fail(
                    f"wrong {name} on rank {self.rank}: holds {mine}, expected "
                    f"{want[self.rank]} ({how})"
                )
            return
        have = [v[0] for v in self.local(name)]
        bad = [q for q in range(self.n) if have[q] != want[q]]
        if bad:
            held = "; ".join(f"rank {q} holds {have[q]}, expected {want[q]}" for q in bad)
            self.fail(f"wrong {name} on {ranks_text(bad)}: {held} ({how}; per rank: {have})")


def _verdict(sig: Signature, table: list[list[int]], region: str, group: Any) -> Agreed:
    """Same checks on the same gathered words on every rank: raise everywhere or nowhere."""
    n = len(table)
    agreed = Agreed(sig, table, n, region)
    prefix = 4 + len(sig.same)  # primitive, status, structure and the fields that must agree
    first = table[0][:prefix]
    if first[1] == 0 and all(row[:prefix] == first for row in table[1:]):
        return agreed  # the common case, decided in one pass
    failed = [q for q in range(n) if table[q][1]]
    if failed:  # first: a rank that rejected its input may have reached another agreement
        messages: list[Any] = [None] * n
        mine = None if sig.error is None else (sig.what, f"{type(sig.error).__name__}: {sig.error}")
        dist.all_gather_object(messages, mine, group=group)
        detail = "; ".join(f"rank {q}: {messages[q][1]}" for q in failed)
        what = next((m[0] for m in messages if m is not None and m[0] is not None), None)
        if what is not None:  # an input validation (validate_collectively)
            raise InputValidationError(
                f"{what} rejected on SP rank(s) {failed} of {n} "
                f"(this is rank {dist.get_rank(group)}): {detail}"
            )
        agreed.fail(f"invalid input on {ranks_text(failed)}: {detail}")
    codes = [r[0] for r in table]
    if len(set(codes)) > 1:
        names = [{c: name for name, c in _CODES.items()}.get(c, "?") for c in codes]
        where = "; ".join(f"rank {q}: {name}" for q, name in enumerate(names))
        agreed.fail(
            f"ranks are in different collectives ({where}): their control flow diverged",
            primitive="/".join(dict.fromkeys(names)),
        )
    if len({(r[2], r[3]) for r in table}) > 1:
        agreed.fail(
            "ranks passed differently structured arguments (e.g. tensors with a different "
            f"number of dims); argument words per rank: {[r[4 : 4 + r[2]] for r in table]}"
        )
    problems, start = [], 4
    for name, kind, width in sig.same_fields:
        values = [tuple(r[start : start + width]) for r in table]
        start += width
        if len(set(values)) > 1:
            groups: dict[tuple[int, ...], list[int]] = {}
            for q, v in enumerate(values):
                groups.setdefault(v, []).append(q)
            # the value most ranks hold (ties: rank 0's) is the reference; the others are wrong
            ref = max(groups, key=lambda v: (len(groups[v]), -groups[v][0]))
            odd = sorted(q for v, qs in groups.items() if v != ref for q in qs)
            parts = [f"{ranks_text(qs)}: {_format(kind, v)}" for v, qs in groups.items()]
            problems.append((odd, f"{name} differs ({'; '.join(parts)})"))
    odd = sorted({q for qs, _ in problems for q in qs})
    agreed.fail(
        f"{ranks_text(odd)} disagree{'s' if len(odd) == 1 else ''} with the group: "
        + "; ".join(text for _, text in problems)
    )


_TRUST = threading.local()  # .groups: id(group) -> group, for groups in an agreed forward


def _trusted() -> dict[int, Any]:
    if not hasattr(_TRUST, "groups"):
        _TRUST.groups = {}
    return _TRUST.groups


@contextlib.contextmanager
def trusted_calls(group: Any) -> Iterator[None]:
    """Inside the block :func:`agree` exchanges nothing on ``group`` (unless debug mode is on).

    The runtime's calls after its entry agreement run so: every collective they make is a
    deterministic function of what was agreed (shapes, lengths, the plan), so ranks cannot
    disagree on it unless the model's own code differs between ranks. Per thread: another
    thread's direct calls on the same group still agree.
    """
    trusted = _trusted()
    before = trusted.get(id(group))
    trusted[id(group)] = group
    try:
        yield
    finally:
        if before is None:
            trusted.pop(id(group), None)
        else:
            trusted[id(group)] = before


def skips_agreement(group: Any) -> bool:
    """Whether :func:`agree` exchanges nothing on ``group`` now (see there)."""
    if SETTINGS.debug:
        return False
    return in_backward() or (group is not None and _trusted().get(id(group)) is group)


def agree(
    sig: Signature, group: Any, device: torch.device | str = "cpu", needs_rows: bool = False
) -> Agreed:
    """Agree on ``sig`` over ``group`` and check it on every rank; the :class:`Agreed` words.

    Raises :class:`CollectiveInputError` on every rank if any rank's ``sig.error`` is set or the
    ``same`` fields differ; otherwise returns the :class:`Agreed` words for the caller's checks
    on the ``free`` fields (which must call :meth:`Agreed.fail` identically on every rank).
    On one process, raises ``sig.error`` if set.

    Nothing is exchanged (only this rank's words are checked) on a group inside an agreed
    forward (:func:`trusted_calls`) and in a backward pass (autograd hands every rank gradients
    of the forward's shapes, and a recomputation under activation checkpointing replays an
    agreed forward), unless debug mode is on or the caller ``needs_rows`` (the other ranks'
    free fields).
    """
    n = group_size(group)
    region = current_region()
    if n == 1:
        if sig.error is not None:
            raise sig.error
        return Agreed(sig, [sig.words(0)], 1, region)
    if not needs_rows and skips_agreement(group):
        if sig.error is not None:
            raise sig.error
        return Agreed(sig, None, n, region, group_rank(group))
    return agree_in_full(sig, group, device)


def agree_in_full(sig: Signature, group: Any, device: torch.device | str = "cpu") -> Agreed:
    """:func:`agree` by one tiny all-gather of every rank's words on the control side group."""
    n = group_size(group)
    region = current_region()
    words = sig.words(int(sig.error is not None))
    control, on_host = control_group(group)
    mine = torch.frombuffer(array.array("q", words), dtype=torch.long)  # no copy (CPU)
    where = torch.device("cpu") if on_host else torch.device(device)
    if where.type != "cpu":  # a NCCL-only group of the user's: device words, a host read
        mine = mine.to(where)
    everyone = torch.empty(n * WIDTH, dtype=torch.long, device=where)
    with guard(sig.primitive, group, region, where):
        all_gather_single(everyone, mine, group=control)
    record_control(sig.primitive, WIDTH * 8 * (n - 1), n, region)
    table = everyone.view(n, WIDTH).tolist()
    agreed = _verdict(sig, table, region, control)
    agreed.rank = group_rank(group)
    return agreed


# --------------------------------------------------------------------------------------------
# backend failures


def group_timeout_s(group: Any, device: torch.device | str = "cpu") -> float | None:
    """The timeout (seconds) of ``group``'s backend for ``device``, if the backend tells."""
    try:
        backend = group._get_backend(torch.device(device))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - any backend without the attribute
        return None


@contextlib.contextmanager
def guard(
    primitive: str, group: Any, region: str | None, device: torch.device | str = "cpu"
) -> Iterator[None]:
    """Re-raise a backend ``RuntimeError`` (timeout, lost peer) naming the primitive and region.

    The wording does not guess which from the time waited: a guard may wrap only the wait of a
    collective launched long before (an overlapped switch)."""
    try:
        yield
    except (CollectiveTimeoutError, torch.OutOfMemoryError):
        raise
    except RuntimeError as exc:
        timeout = group_timeout_s(group, device)
        limit = "" if timeout is None else f" of {timeout:g} s"
        raise CollectiveTimeoutError(
            f"{primitive} (comm region '{region or '-'}', group of {group_size(group)} ranks, "
            f"this is rank {group_rank(group)}) failed in the backend (at its timeout{limit} if "
            "a peer never came; sooner if a peer died or closed its connection): another "
            "rank did not reach this collective (it raised, hung or took another path) or died. "
            "Look for the first error in the other ranks' logs; the timeout is set by "
            "build_mesh(timeout_s=...) or DSPZOO_COLLECTIVE_TIMEOUT (seconds). "
            f"Backend said: {exc}"
        ) from exc

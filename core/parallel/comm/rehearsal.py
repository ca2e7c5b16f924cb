"""The agreed calls of one group, in order: what every rank expects the group's next call to be.

A model calls the same collectives with the same arguments step after step. Once the group
has agreed on a call (:func:`~.agreement.agree`, one tiny all-gather), every rank of the group
holds the same gathered table of that call; kept in order, these tables predict the next call
on **every rank alike**, because the history is built only from what the whole group saw
(gathered tables, and the status words every rank received in folded calls). So ranks can
compute the split sizes of the next collective from the prediction — metadata they already
agree on — rather than from their own input, and need no separate agreement before it: a rank
whose own call differs from the prediction (a wrong shard, dtype, shape, another primitive)
still takes part in the predicted collective, with zeros and a ``miss`` status word folded into
the payload, and every rank, seeing that word, then runs the full agreement to learn what went
wrong (or, when the prediction was merely stale — a new shape —, to redo the call).

The prediction is the call that followed the group's previous call the last time that call
was made (a table of successors keyed by the previous call's table, bounded, evicted in the
same order on every rank). A model's steady state repeats, so after its first step every call
is predicted, except where one call is followed by different calls at different points of a
step (the last layer's call followed by the head's instead of the next layer's): there the
prediction misses once and is corrected — such a call costs the wasted folded exchange plus the
full agreement. Only calls that a primitive can fold (:attr:`Entry.plan`, set by the primitive
on every rank alike after its agreement passed) are predicted; any other call is agreed in
full.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_ENTRIES = 1024  # successors kept per group (least recently recorded dropped first)

Table = tuple[tuple[int, ...], ...]


@dataclass
class Entry:
    """One agreed call: the gathered words of every rank, and this rank's plan to fold it.

    ``plan`` is primitive-specific (for ``switch``: this rank's split sizes and dtype, so a
    rank whose own input is wrong can still take part with zeros of the right size).
    """

    table: list[list[int]]
    plan: Any = None
    key: Table = ()

    def __post_init__(self) -> None:
        self.key = tuple(tuple(row) for row in self.table)


@dataclass
class Rehearsal:
    """The agreed calls of one group: which call followed which; the same on every rank."""

    successors: OrderedDict[Table | None, Entry] = field(default_factory=OrderedDict)
    last: Table | None = None  # the group's previous call (None: none yet)
    hits: int = 0  # calls run folded (no separate agreement)
    misses: int = 0  # predicted calls that some rank did not match (full agreement followed)
    _undo: tuple[Table | None, Entry | None] | None = field(default=None, repr=False)
    # this rank's signatures of recent calls, by their local arguments (a cache of a pure
    # function of them, so it need not be the same on every rank)
    signatures: dict[Any, Any] = field(default_factory=dict, repr=False)

    def predicted(self) -> Entry | None:
        """The group's expected next call, if it can be folded; the same on every rank."""
        entry = self.successors.get(self.last)
        return entry if entry is not None and entry.plan is not None else None

    def matched(self, entry: Entry) -> None:
        """Every rank matched the prediction ``entry`` (its status words said so)."""
        self.last = entry.key
        self.hits += 1

    def missed(self) -> None:
        """Some rank did not match the prediction; a full agreement follows."""
        self.misses += 1

    def agreed(self, table: list[list[int]]) -> Entry:
        """Record a call agreed in full as the successor of the previous call; its entry."""
        entry = before = self.successors.get(self.last)
        self._undo = (self.last, before)
        if entry is None or entry.table != table:
            entry = Entry(table)
            self.successors[self.last] = entry
            self.successors.move_to_end(self.last)
            while len(self.successors) > MAX_ENTRIES:
                self.successors.popitem(last=False)
        self.last = entry.key
        return entry

    def undo(self) -> None:
        """Forget the call just recorded by :meth:`agreed` (its caller's checks failed on every rank)."""
        if self._undo is None:
            return
        last, before = self._undo
        self._undo = None
        if before is None:
            self.successors.pop(last, None)
        else:
            self.successors[last] = before
        self.last = last

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

The prediction is the entry after the last matched one: a *lap* of the calls of one training
step repeats (the last entry wraps around to the first); a call that differs starts a new
branch (the entries after it are dropped), or a new lap when it equals the first entry. Only
calls that a primitive can fold (:attr:`Entry.plan` set by the primitive, on every rank alike
after its agreement passed) are predicted; any other next call is agreed in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_ENTRIES = 1024  # a lap longer than this (or a never-repeating sequence) starts over


@dataclass
class Entry:
    """One agreed call: the gathered words of every rank, and this rank's plan to fold it.

    ``plan`` is primitive-specific (for ``switch``: this rank's split sizes and dtype, so a
    rank whose own input is wrong can still take part with zeros of the right size).
    """

    table: list[list[int]]
    plan: Any = None


@dataclass
class Rehearsal:
    """The agreed calls of one group in order, and the position of the next call among them."""

    entries: list[Entry] = field(default_factory=list)
    cursor: int = 0
    hits: int = 0  # calls run folded (no separate agreement)
    misses: int = 0  # predicted calls that some rank did not match (full agreement followed)

    def predicted(self) -> Entry | None:
        """The group's expected next call, if it can be folded; the same on every rank."""
        if not self.entries:
            return None
        entry = self.entries[self.cursor] if self.cursor < len(self.entries) else self.entries[0]
        return entry if entry.plan is not None else None

    def _index(self) -> int:
        return self.cursor if self.cursor < len(self.entries) else 0

    def matched(self) -> None:
        """Every rank matched the prediction (its status words said so): move past it."""
        self.cursor = self._index() + 1
        self.hits += 1

    def missed(self) -> None:
        """Some rank did not match the prediction; a full agreement follows."""
        self.misses += 1

    def agreed(self, table: list[list[int]]) -> Entry:
        """Record a call agreed in full at the current position; returns its entry."""
        if self.entries and table == self.entries[0].table:  # a new lap
            self.cursor = 1
            return self.entries[0]
        if self.cursor < len(self.entries) and table == self.entries[self.cursor].table:
            self.cursor += 1  # the entry was not foldable, or some rank fell back to agreeing
            return self.entries[self.cursor - 1]
        if self.cursor >= MAX_ENTRIES:
            self.entries, self.cursor = [], 0
        del self.entries[self.cursor :]  # a new branch from here
        entry = Entry(table)
        self.entries.append(entry)
        self.cursor += 1
        return entry

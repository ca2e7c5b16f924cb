"""Stage declarations and the switch-schedule planner.

A model declares its sequence dims and, for each computation stage, the dims it *mixes*
(needs whole). Under DSP a stage runs locally when the sharded dim is one it does not mix;
the planner picks the sharded dim of every stage so that the number of switches, each moving
``(M/N)·(N−1)/N`` elements per rank whatever the pair of dims, is minimal. Ties prefer dims
that ``N`` divides, dims long enough to give every rank a row, and switching as late as
possible (so a switch sits right before the stage that needs it).

Stages usually repeat (one transformer layer after another): :func:`plan_stages` treats the
stage list as periodic by default and counts the switch from the last stage back to the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SWITCH_COST = 1.0
UNEVEN_COST = 1e-3  # per stage sharded on a dim N does not divide (imbalanced shards)
UNDERFILLED_COST = 100.0  # per stage sharded on a dim shorter than N (idle ranks)


@dataclass(frozen=True)
class Stage:
    """One computation stage: ``name`` mixes tokens along the dims in ``mixes``.

    ``mixes=()`` is a token-wise stage (MLP, cross-attention to replicated conditioning).
    """

    name: str
    mixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.mixes, str):
            object.__setattr__(self, "mixes", (self.mixes,))


@dataclass(frozen=True)
class PlanStep:
    """The sharded dim during one stage, and the switch (if any) that precedes it."""

    stage: str
    mixes: tuple[str, ...]
    sharded: str
    switch_from: str | None = None
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """A switch schedule for one period of stages (see :func:`plan_stages`)."""

    dims: tuple[str, ...]
    lengths: tuple[int, ...]
    sp_size: int
    periodic: bool
    steps: tuple[PlanStep, ...]
    _by_stage: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for step in self.steps:
            seen = self._by_stage.setdefault(step.stage, step.sharded)
            if seen != step.sharded:
                raise ValueError(
                    f"stage name {step.stage!r} is planned on two dims; give repeated stages distinct names"
                )

    @property
    def entry(self) -> str:
        """The dim to split on when the model enters the sharded region."""
        return self.steps[0].sharded

    @property
    def switches_per_period(self) -> int:
        """Switches per period (per layer for periodic plans)."""
        return sum(step.switch_from is not None for step in self.steps)

    def sharded_for(self, stage: str) -> str:
        """The dim that must be sharded while ``stage`` runs."""
        try:
            return self._by_stage[stage]
        except KeyError:
            raise ValueError(
                f"stage {stage!r} is not in the plan; planned stages: {list(self._by_stage)}"
            ) from None

    def switch_bytes_per_period(self, global_elements: int, itemsize: int) -> float:
        """Bytes each rank sends per period: switches · (M/N) · (N−1)/N · itemsize."""
        n = self.sp_size
        return self.switches_per_period * global_elements / n * (n - 1) / n * itemsize

    def __str__(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in zip(self.dims, self.lengths))
        lines = [
            f"DSP plan over ({dims}) at SP size {self.sp_size}: "
            f"{self.switches_per_period} switch(es) per {'layer' if self.periodic else 'pass'}, entry split on {self.entry!r}",
            f"  {'stage':<20} {'mixes':<12} {'sharded':<8} switch",
        ]
        for step in self.steps:
            mixes = ",".join(step.mixes) or "-"
            sw = f"{step.switch_from} -> {step.sharded}" if step.switch_from else ""
            note = f"  ({step.note})" if step.note else ""
            lines.append(f"  {step.stage:<20} {mixes:<12} {step.sharded:<8} {sw}{note}")
        return "\n".join(lines)


def _stage_cost(dim: str, length: int, sp_size: int) -> float:
    if length < sp_size:
        return UNDERFILLED_COST
    return UNEVEN_COST if length % sp_size else 0.0


def plan_stages(
    dims: tuple[str, ...],
    lengths: tuple[int, ...],
    stages: tuple[Stage, ...] | list[Stage],
    sp_size: int,
    periodic: bool = True,
) -> Plan:
    """Choose the sharded dim of every stage to minimise communication.

    Args:
        dims: sequence dim names, e.g. ``("t", "h", "w")``.
        lengths: their global lengths.
        stages: the stage sequence of one period (one layer) or of the whole model.
        sp_size: ranks in the SP group.
        periodic: the stages repeat, so the last stage is followed by the first.

    Raises ``ValueError`` for unknown dims and for stages that mix every dim (those need an
    embedded strategy such as Ulysses or ring attention for that stage: a hybrid plan).
    """
    dims, lengths, stages = tuple(dims), tuple(lengths), tuple(stages)
    if len(dims) != len(lengths):
        raise ValueError(f"{len(dims)} dims {dims} but {len(lengths)} lengths {lengths}")
    if not stages:
        raise ValueError("plan_stages needs at least one stage")
    length_of = dict(zip(dims, lengths))
    options: list[list[str]] = []
    for stage in stages:
        unknown = [d for d in stage.mixes if d not in length_of]
        if unknown:
            raise ValueError(
                f"stage {stage.name!r} mixes unknown dim(s) {unknown}; the sequence dims are {dims}"
            )
        free = [d for d in dims if d not in stage.mixes]
        if not free:
            raise ValueError(
                f"stage {stage.name!r} mixes every sequence dim {dims}, so DSP cannot keep any dim sharded "
                f"through it; run it with an embedded strategy (ulysses/ring) in a hybrid plan, or split it "
                f"into axial stages"
            )
        options.append(free)

    k = len(stages)

    def cost_to_go(start: str | None) -> list[dict[str, float]]:
        """``table[i][d]``: least cost of stages ``i..k-1`` with stage ``i`` sharded on ``d``."""
        table: list[dict[str, float]] = [{} for _ in range(k)]
        for i in reversed(range(k)):
            for d in options[i]:
                here = _stage_cost(d, length_of[d], sp_size)
                if i == k - 1:
                    tail = SWITCH_COST if (start is not None and d != start) else 0.0
                else:
                    tail = min(
                        table[i + 1][e] + (SWITCH_COST if e != d else 0.0) for e in options[i + 1]
                    )
                table[i][d] = here + tail
        return table

    best: tuple[float, list[str]] | None = None
    for first in options[0]:
        table = cost_to_go(first if periodic else None)
        total = table[0][first]
        choice = [first]
        for i in range(1, k):
            prev = choice[-1]
            remaining = table[i - 1][prev] - _stage_cost(prev, length_of[prev], sp_size)
            stay_ok = prev in table[i] and abs(table[i][prev] - remaining) < 1e-9
            choice.append(
                prev
                if stay_ok
                else min(
                    options[i], key=lambda e, p=prev: table[i][e] + (SWITCH_COST if e != p else 0.0)
                )
            )
        if best is None or total < best[0] - 1e-9:
            best = (total, choice)
    assert best is not None
    choice = best[1]
    steps = []
    for i, (stage, dim) in enumerate(zip(stages, choice)):
        prev = choice[i - 1] if i > 0 else (choice[-1] if periodic else None)
        note = ""
        if length_of[dim] < sp_size:
            note = f"{dim}={length_of[dim]} < SP size {sp_size}: some ranks idle"
        elif length_of[dim] % sp_size:
            note = f"{dim}={length_of[dim]} not divisible by {sp_size}: uneven shards"
        steps.append(
            PlanStep(stage.name, stage.mixes, dim, prev if prev not in (None, dim) else None, note)
        )
    return Plan(dims=dims, lengths=lengths, sp_size=sp_size, periodic=periodic, steps=tuple(steps))

"""Stage declarations and the switch-schedule planner.

A model declares its sequence dims and, for each computation stage, the dims it *mixes*
(needs whole). Under DSP a stage runs locally when the sharded dim is one it does not mix;
the planner picks the sharded dim of every stage so that the number of switches, each moving
``(M/N)·(N−1)/N`` elements per rank whatever the pair of dims, is minimal. Ties prefer dims
that ``N`` divides, dims long enough to give every rank a row, and switching as late as
possible (so a switch sits right before the stage that needs it).

Stages usually repeat (one transformer layer after another): :func:`plan_stages` treats the
stage list as periodic by default and counts the switch from the last stage back to the first.

A plan says, per stage, the sharded dim **and the method** that runs the stage:

* ``local``: the stage does not mix the sharded dim, so it runs with no communication (DSP);
* an embedded method (``ulysses``, ``ring``, ``lss``, ``usp``) for a stage whose attention mixes
  the sharded dim: a stage that mixes *every* dim in an otherwise-DSP model (a *hybrid* plan,
  the method chosen by communication volume), or every mixing stage under a fixed-dim
  embedded strategy (:func:`plan_fixed`).

Costs are in units of one switch, ``(M/N)·(N−1)/N`` elements per rank (``M``: the activation's
global size). Per attention stage an embedded method sends, per rank: Ulysses four all-to-alls
(q, k, v, output) = 4 units; Ring and LSS receive the other ranks' K and V,
``2·(N−1)·M/N`` elements = ``2N`` units. Megatron-SP (``megatron_sp``, tensor parallelism
over the SP group) all-gathers the sequence before each column-parallel linear and
reduce-scatters after its row-parallel partner: ``2·(N−1)·M/N`` elements = ``2N`` units per
linear pair, on every stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SWITCH_COST = 1.0
UNEVEN_COST = 1e-3  # per stage sharded on a dim N does not divide (imbalanced shards)
UNDERFILLED_COST = 100.0  # per stage sharded on a dim shorter than N (idle ranks)


EMBEDDED_METHODS = ("ulysses", "ring", "lss", "usp")
# tensor-parallel methods: every stage runs with them (the MLPs are sharded too), never chosen
# per stage by the DSP planner
TENSOR_PARALLEL_METHODS = ("megatron_sp",)
METHODS = ("local", *EMBEDDED_METHODS, *TENSOR_PARALLEL_METHODS)


def embedded_method_cost(method: str, sp_size: int) -> float:
    """Forward bytes per rank of one attention stage under ``method``, in switch units."""
    if method == "local":
        return 0.0
    if method == "ulysses":
        return 4.0
    if method in ("ring", "lss", "usp"):
        return 2.0 * sp_size
    if method == "megatron_sp":  # per linear pair: all-gather + reduce-scatter of M
        return 2.0 * sp_size
    raise ValueError(f"unknown attention method {method!r}; known: {list(METHODS)}")


@dataclass(frozen=True)
class Stage:
    """One computation stage: ``name`` mixes tokens along the dims in ``mixes``.

    ``mixes=()`` is a token-wise stage (MLP, cross-attention to replicated conditioning).
    ``method`` forces the embedded method of a stage that mixes every dim (default: the
    planner's choice); ``heads`` (its attention heads, if known) lets the planner avoid
    Ulysses where heads are fewer than ranks. ``embed_if_underfilled``: when every dim the
    stage leaves free is shorter than the SP size (some ranks would idle, e.g. a 2-step time
    window at SP 8 under a full-spatial attention), the planner may instead shard a dim the
    stage mixes and run it with an embedded method, as for a stage that mixes every dim.
    """

    name: str
    mixes: tuple[str, ...] = ()
    method: str | None = None
    heads: int | None = None
    embed_if_underfilled: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.mixes, str):
            object.__setattr__(self, "mixes", (self.mixes,))
        if self.method is not None and self.method not in EMBEDDED_METHODS:
            raise ValueError(
                f"stage {self.name!r}: method must be one of {list(EMBEDDED_METHODS)}, got "
                f"{self.method!r}"
            )


@dataclass(frozen=True)
class PlanStep:
    """The sharded dim during one stage, the method that runs it, and the switch before it."""

    stage: str
    mixes: tuple[str, ...]
    sharded: str
    switch_from: str | None = None
    note: str = ""
    method: str = "local"


@dataclass(frozen=True)
class Plan:
    """A switch schedule for one period of stages (see :func:`plan_stages`)."""

    dims: tuple[str, ...]
    lengths: tuple[int, ...]
    sp_size: int
    periodic: bool
    steps: tuple[PlanStep, ...]
    strategy: str = "dsp"
    layout: str = "contiguous"
    _by_stage: dict[str, PlanStep] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for step in self.steps:
            seen = self._by_stage.setdefault(step.stage, step)
            if (seen.sharded, seen.method) != (step.sharded, step.method):
                raise ValueError(
                    f"stage name {step.stage!r} is planned twice differently; give repeated "
                    f"stages distinct names"
                )

    @property
    def entry(self) -> str:
        """The dim to split on when the model enters the sharded region."""
        return self.steps[0].sharded

    @property
    def switches_per_period(self) -> int:
        """Switches per period (per layer for periodic plans)."""
        return sum(step.switch_from is not None for step in self.steps)

    @property
    def methods(self) -> dict[str, str]:
        """The method of every stage, ``{stage: method}``."""
        return {step.stage: step.method for step in self.steps}

    def step_for(self, stage: str) -> PlanStep:
        """The :class:`PlanStep` of ``stage``."""
        try:
            return self._by_stage[stage]
        except KeyError:
            raise ValueError(
                f"stage {stage!r} is not in the plan; planned stages: {list(self._by_stage)}"
            ) from None

    def sharded_for(self, stage: str) -> str:
        """The dim that must be sharded while ``stage`` runs."""
        return self.step_for(stage).sharded

    def method_for(self, stage: str) -> str:
        """The method that runs ``stage`` (``"local"``: no communication inside it)."""
        return self.step_for(stage).method

    def switch_bytes_per_period(self, global_elements: int, itemsize: int) -> float:
        """Bytes each rank sends per period: switches · (M/N) · (N−1)/N · itemsize."""
        n = self.sp_size
        return self.switches_per_period * global_elements / n * (n - 1) / n * itemsize

    def __str__(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in zip(self.dims, self.lengths))
        embedded = sorted({s.method for s in self.steps if s.method != "local"})
        kind = self.strategy.upper() if self.strategy != "dsp" else "DSP"
        if self.strategy == "dsp" and embedded:
            kind = f"Hybrid DSP + {'/'.join(embedded)}"
        lines = [
            f"{kind} plan over ({dims}) at SP size {self.sp_size}: "
            f"{self.switches_per_period} switch(es) per {'layer' if self.periodic else 'pass'}, entry split on {self.entry!r}",
            f"  {'stage':<20} {'mixes':<12} {'sharded':<8} {'method':<8} switch",
        ]
        for step in self.steps:
            mixes = ",".join(step.mixes) or "-"
            sw = f"{step.switch_from} -> {step.sharded}" if step.switch_from else ""
            note = f"  ({step.note})" if step.note else ""
            lines.append(
                f"  {step.stage:<20} {mixes:<12} {step.sharded:<8} {step.method:<8} {sw}{note}"
            )
        return "\n".join(lines)


def _stage_cost(dim: str, length: int, sp_size: int) -> float:
    if length < sp_size:
        return UNDERFILLED_COST
    return UNEVEN_COST if length % sp_size else 0.0


def choose_method(stage: Stage, sp_size: int) -> str:
    """The embedded method for a stage that mixes every dim: the cheapest that fits.

    Ulysses (4 units) unless the stage's heads are fewer than the ranks (then some ranks would
    hold no head and idle); otherwise Ring (``2N`` units, no head constraint).
    """
    if stage.method is not None:
        return stage.method
    if stage.heads is not None and stage.heads < sp_size:
        return "ring"
    return min(("ulysses", "ring"), key=lambda m: embedded_method_cost(m, sp_size))


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

    A stage that mixes every dim cannot keep any dim whole-free: it gets an embedded method
    (:func:`choose_method`; ``Stage.method`` forces one) on whichever dim is cheapest, and the
    plan becomes a hybrid. Raises ``ValueError`` for unknown dims.
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
        underfilled = all(length_of[d] < sp_size for d in free)
        if stage.embed_if_underfilled and free and underfilled:
            options.append(list(dims))  # idle ranks on a free dim, or a mixed dim embedded
        else:
            options.append(free or list(dims))  # every dim mixed: an embedded method, any dim
    # the method of stage i sharded on dim d: local on a free dim, else an embedded method
    methods = [
        {d: "local" if d not in st.mixes else choose_method(st, sp_size) for d in opts}
        for st, opts in zip(stages, options)
    ]
    method_cost = [{d: embedded_method_cost(m, sp_size) for d, m in ms.items()} for ms in methods]

    k = len(stages)

    def cost_to_go(start: str | None) -> list[dict[str, float]]:
        """``table[i][d]``: least cost of stages ``i..k-1`` with stage ``i`` sharded on ``d``."""
        table: list[dict[str, float]] = [{} for _ in range(k)]
        for i in reversed(range(k)):
            for d in options[i]:
                here = _stage_cost(d, length_of[d], sp_size) + method_cost[i][d]
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
            remaining = (
                table[i - 1][prev]
                - _stage_cost(prev, length_of[prev], sp_size)
                - method_cost[i - 1][prev]
            )
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
            PlanStep(
                stage.name,
                stage.mixes,
                dim,
                prev if prev not in (None, dim) else None,
                note,
                methods[i][dim],
            )
        )
    return Plan(dims=dims, lengths=lengths, sp_size=sp_size, periodic=periodic, steps=tuple(steps))


def plan_fixed(
    dims: tuple[str, ...],
    lengths: tuple[int, ...],
    stages: tuple[Stage, ...] | list[Stage],
    sp_size: int,
    method: str,
    dim: str | None = None,
    periodic: bool = True,
    layout: str = "contiguous",
) -> Plan:
    """The plan of a fixed-dim embedded strategy: one dim sharded throughout, no switches.

    Every stage that mixes the sharded ``dim`` runs with ``method``; the others run locally.
    A tensor-parallel ``method`` (``megatron_sp``) is put in force on *every* stage: its
    linears (attention and MLP alike) gather the sequence and shard heads / hidden units.
    ``dim`` defaults to the longest dim (ties: the first), the most balanced choice.
    ``layout="zigzag"`` (ring only) cuts the dim into ``2N`` chunks, rank ``r`` holding chunks
    ``r`` and ``2N−1−r``, which balances causal attention's work over the ring.
    """
    known = (*EMBEDDED_METHODS, *TENSOR_PARALLEL_METHODS)
    if method not in known:
        raise ValueError(f"method must be one of {list(known)}, got {method!r}")
    every_stage = method in TENSOR_PARALLEL_METHODS
    if layout not in ("contiguous", "zigzag") or (layout == "zigzag" and method != "ring"):
        raise ValueError(f"layout {layout!r} is not available with method {method!r}")
    dims, lengths, stages = tuple(dims), tuple(lengths), tuple(stages)
    if len(dims) != len(lengths):
        raise ValueError(f"{len(dims)} dims {dims} but {len(lengths)} lengths {lengths}")
    if not stages:
        raise ValueError("plan_fixed needs at least one stage")
    length_of = dict(zip(dims, lengths))
    if dim is None:
        dim = max(dims, key=lambda d: (length_of[d], -dims.index(d)))
    if dim not in length_of:
        raise ValueError(f"cannot shard unknown dim {dim!r}; the sequence dims are {dims}")
    for stage in stages:
        unknown = [d for d in stage.mixes if d not in length_of]
        if unknown:
            raise ValueError(
                f"stage {stage.name!r} mixes unknown dim(s) {unknown}; the sequence dims are {dims}"
            )
    note = ""
    if length_of[dim] < sp_size:
        note = f"{dim}={length_of[dim]} < SP size {sp_size}: some ranks idle"
    elif length_of[dim] % sp_size:
        note = f"{dim}={length_of[dim]} not divisible by {sp_size}: uneven shards"
    steps = tuple(
        PlanStep(
            stage.name,
            stage.mixes,
            dim,
            None,
            note,
            method if every_stage or dim in stage.mixes else "local",
        )
        for stage in stages
    )
    return Plan(
        dims=dims,
        lengths=lengths,
        sp_size=sp_size,
        periodic=periodic,
        steps=steps,
        strategy=method if layout == "contiguous" else f"{method}_{layout}",
        layout=layout,
    )

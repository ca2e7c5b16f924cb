"""The one planner: the sharded dim and the method of every activation at every stage.

A model declares its activations (:class:`ActShape`: dims, lengths, channels), which dims of
different activations are the same axis (``same_axis``), and its stages (:class:`MultiStage`):
per activation the dims the stage mixes, the op kind it computes (``attention``, ``generic``,
or a registered kind), what it gathers for local use, which activations it aligns. A
single-activation model (:func:`dspzoo.core.parallel.plan.plan_stages`) is the one-activation case.

A *policy* (:class:`Policy`, built by a strategy) says which options each stage has:

* ``dsp``: local on any dim the stage does not mix; a stage that mixes every dim runs with the
  cheapest *hybrid* method of its op kind (for attention Ulysses, or Ring, or the balanced ring
  where the stage is causal) or, for an op kind without one (generic), with ``gather`` (the
  activation whole on every rank for the stage);
* ``fixed`` (Ulysses, Ring, LSS, USP, Megatron-SP): one dim stays sharded; a stage that mixes
  it runs with the policy's method *if the method runs the stage's op kind*, otherwise the
  stage gets its dims whole the DSP way (a switch to a free dim, or ``gather``) — exact under
  every strategy, never an attention method on a convolution.

Every option is priced in one unit, *elements sent per rank, forward + backward*, read from
the method registry (:mod:`dspzoo.core.parallel.methods.registry`): a switch of activation ``a`` costs
``2·(M_a/N)·(N−1)/N``, a method ``plan_cost`` switch units of it. Ranks that idle or wait on a
bigger shard (a dim shorter than ``N``, or not divisible by it) cost their lost compute: the
busiest rank's excess elements over a balanced split, times :attr:`Pricing.compute_weight`
(the cost of pushing one element through a stage, forward and backward, relative to sending
one element once). A dynamic program over the stages (cyclic for periodic plans) finds the
cheapest schedule; ties keep each activation where it is (switch as late as possible), then
the fewest switches at the wrap-around, then declaration order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .layout import shard_sizes
from .methods.registry import get_method, get_op_kind, methods_for
from .trace import format_bytes

DEFAULT_COMPUTE_WEIGHT = 16.0


@dataclass(frozen=True)
class Pricing:
    """How the planner weighs lost compute against bytes (see the module docstring).

    ``compute_weight``: one element's forward + backward compute through one stage, in units
    of sending one element once. The default, 16, is one fixed figure for every model: in the
    cost model (bf16, ``h100-nvlink-ib``) trading balance for switches pays from a hidden
    width of about 2K, so narrow models on uneven shapes switch more than they should (the
    video Mamba DiT at hidden 64, t = 5 at SP 3: 0.22 ms per step planned against 0.16 ms
    without its MLP's two switches; docs/mamba.md). A weight derived from the workload and
    the cluster is not built; pass a ``Pricing`` to the planner to choose another.
    """

    compute_weight: float = DEFAULT_COMPUTE_WEIGHT


@dataclass(frozen=True)
class ActShape:
    """An activation ``[B, *dims, channels]``: its dim names, global lengths and channels."""

    dims: tuple[str, ...]
    lengths: tuple[int, ...]
    channels: int

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.lengths):
            raise ValueError(
                f"ActShape: {len(self.dims)} dims {self.dims} but lengths {self.lengths}"
            )

    def length(self, dim: str) -> int:
        """Global length of ``dim``."""
        if dim not in self.dims:
            raise ValueError(f"unknown dim {dim!r}; this activation has dims {self.dims}")
        return self.lengths[self.dims.index(dim)]

    def positions(self, exclude: tuple[str, ...] = ()) -> int:
        """Product of the lengths of the dims not in ``exclude``."""
        return math.prod(n for d, n in zip(self.dims, self.lengths) if d not in exclude)

    @property
    def elements(self) -> int:
        """Global elements per sample: positions × channels."""
        return self.positions() * self.channels


@dataclass(frozen=True)
class Gather:
    """An operand a stage all-gathers along an activation's sharded dim.

    Shaped like ``activation`` with ``channels`` channels (e.g. the pair bias of MSA row
    attention: like ``z`` with one channel per head). Backward: a reduce-scatter of the same size.
    """

    activation: str
    channels: int
    label: str = ""


@dataclass(frozen=True)
class MultiStage:
    """One stage: the activations it touches, the dims it mixes in each, what it computes.

    ``mixes`` maps every activation the stage reads or writes to the dims it needs whole
    (``()``: touched, token-wise). ``op``: the op kind of the mixing (a registered kind,
    :mod:`dspzoo.core.parallel.methods.registry`). ``method`` forces the method of a stage that mixes
    every dim; ``heads`` lets the planner rule out methods that need more heads than ranks;
    ``embed_if_underfilled`` lets a stage whose free dims are all shorter than the SP size run
    a mixed dim with a method instead. ``aligned`` lists activations whose sharded dims must
    be the same axis; ``gathers`` the operands it all-gathers for local use. ``causal``: its
    attention is causal (methods are priced by what they send under the mask).
    """

    name: str
    mixes: Mapping[str, tuple[str, ...] | str] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()
    gathers: tuple[Gather, ...] = ()
    op: str = "attention"
    method: str | None = None
    heads: int | None = None
    embed_if_underfilled: bool = False
    causal: bool = False

    def __post_init__(self) -> None:
        items = self.mixes.items() if isinstance(self.mixes, Mapping) else self.mixes
        norm = tuple((a, (d,) if isinstance(d, str) else tuple(d)) for a, d in items)
        object.__setattr__(self, "mixes", norm)
        get_op_kind(self.op)
        for g in self.gathers:
            if g.activation not in self.touches:
                raise ValueError(
                    f"stage {self.name!r} gathers along {g.activation!r} but does not list it in mixes"
                )
        for a in self.aligned:
            if a not in self.touches:
                raise ValueError(f"stage {self.name!r}: aligned activation {a!r} is not in mixes")

    @property
    def touches(self) -> tuple[str, ...]:
        """The activations the stage reads or writes."""
        return tuple(a for a, _ in self.mixes)  # type: ignore[misc]

    def mixed(self, activation: str) -> tuple[str, ...]:
        """The dims of ``activation`` this stage needs whole."""
        return dict(self.mixes).get(activation, ())  # type: ignore[arg-type]

    def __hash__(self) -> int:
        return hash((self.name, self.mixes, self.aligned, self.gathers, self.op, self.method))


@dataclass(frozen=True)
class Switch:
    """Activation ``activation`` switches ``src`` → ``dst`` before a stage.

    ``launch_after``: the last earlier stage that touches the activation (cyclically for
    periodic plans); the switch may be launched asynchronously right after it and overlap the
    stages in between. ``None`` when the switch directly follows a stage that touches it.
    """

    activation: str
    src: str
    dst: str
    launch_after: str | None = None


@dataclass(frozen=True)
class MultiStep:
    """One stage of a plan: the sharded dim and method of every activation, the switches
    before it. ``methods`` omits activations that run ``local``."""

    stage: MultiStage
    sharded: tuple[tuple[str, str], ...]
    switches: tuple[Switch, ...] = ()
    methods: tuple[tuple[str, str], ...] = ()

    def dim(self, activation: str) -> str:
        """The sharded dim of ``activation`` during this stage."""
        return dict(self.sharded)[activation]

    def method(self, activation: str) -> str:
        """The method that runs ``activation``'s mixing in this stage (``"local"``: none)."""
        return dict(self.methods).get(activation, "local")


@dataclass(frozen=True)
class MultiPlan:
    """A schedule over one or several activations for one period of stages."""

    shapes: tuple[tuple[str, ActShape], ...]
    same_axis: tuple[frozenset[str], ...]
    sp_size: int
    periodic: bool
    steps: tuple[MultiStep, ...]
    strategy: str = "dsp"
    layout: str = "contiguous"

    @property
    def names(self) -> tuple[str, ...]:
        """Activation names, in declaration order."""
        return tuple(n for n, _ in self.shapes)

    def shape(self, activation: str) -> ActShape:
        """The :class:`ActShape` of ``activation``."""
        try:
            return dict(self.shapes)[activation]
        except KeyError:
            raise ValueError(
                f"unknown activation {activation!r}; known: {list(self.names)}"
            ) from None

    def step_for(self, stage: str) -> MultiStep:
        """The step of ``stage`` (a clear error for an unknown name)."""
        for step in self.steps:
            if step.stage.name == stage:
                return step
        raise ValueError(
            f"stage {stage!r} is not in the plan; stages: {[s.stage.name for s in self.steps]}"
        )

    def entry(self, activation: str) -> str:
        """The dim ``activation`` is sharded on when the model enters the region."""
        return self.steps[0].dim(activation)

    def launches_after(self, stage: str) -> tuple[tuple[str, Switch], ...]:
        """``(target stage, switch)`` for the overlapped switches launched right after ``stage``."""
        return tuple(
            (step.stage.name, sw)
            for step in self.steps
            for sw in step.switches
            if sw.launch_after == stage
        )

    @property
    def switches_per_period(self) -> int:
        """Switches per period (per block), all activations together."""
        return sum(len(step.switches) for step in self.steps)

    # -- bytes ------------------------------------------------------------------------------
    def comm_bytes(
        self, rank: int = 0, batch: int = 1, itemsize: int = 4
    ) -> dict[tuple[str, str, str], int]:
        """Exact bytes rank ``rank`` sends in one period, ``{(stage, op, phase): bytes}``.

        Switches (all-to-all): the blocks addressed to other ranks, forward and (reversed)
        backward. Gathers: ``(N−1)·`` the longest shard (all-gather forward, reduce-scatter
        backward), as :mod:`dspzoo.core.parallel.comm` sends them. Zero for one rank.
        """
        n = self.sp_size
        out: dict[tuple[str, str, str], int] = {}

        def add(key: tuple[str, str, str], nbytes: int) -> None:
            out[key] = out.get(key, 0) + int(nbytes)

        if n == 1:
            return out
        for step in self.steps:
            name = step.stage.name
            for sw in step.switches:
                shp = self.shape(sw.activation)
                a = shard_sizes(shp.length(sw.src), n)
                z = shard_sizes(shp.length(sw.dst), n)
                other = batch * shp.positions((sw.src, sw.dst)) * shp.channels * itemsize
                add((name, "all_to_all", "forward"), a[rank] * (sum(z) - z[rank]) * other)
                add((name, "all_to_all", "backward"), z[rank] * (sum(a) - a[rank]) * other)
            for g in step.stage.gathers:
                shp = self.shape(g.activation)
                dim = step.dim(g.activation)
                longest = max(shard_sizes(shp.length(dim), n))
                chunk = batch * longest * shp.positions((dim,)) * g.channels * itemsize
                add((name, "all_gather", "forward"), (n - 1) * chunk)
                add((name, "reduce_scatter", "backward"), (n - 1) * chunk)
        return out

    def bytes_per_period(
        self, rank: int = 0, batch: int = 1, itemsize: int = 4, phase: str | None = None
    ) -> int:
        """Total bytes per period of rank ``rank`` (one phase or both)."""
        return sum(
            b
            for (_, _, p), b in self.comm_bytes(rank, batch, itemsize).items()
            if phase is None or p == phase
        )

    def describe(self, batch: int = 1, itemsize: int = 4, rank: int = 0) -> str:
        """The plan as a table: sharded dims per stage, switches, gathers, bytes per rank."""
        lengths = "; ".join(
            f"{a}[" + ", ".join(f"{d}={n}" for d, n in zip(s.dims, s.lengths)) + f"] x{s.channels}"
            for a, s in self.shapes
        )
        counts = self.comm_bytes(rank, batch, itemsize)
        fwd = sum(b for (_, _, p), b in counts.items() if p == "forward")
        bwd = sum(b for (_, _, p), b in counts.items() if p == "backward")
        header = f"DSP multi-activation plan over {lengths} at SP size {self.sp_size}: "
        header += (
            f"{self.switches_per_period} switch(es) per {'block' if self.periodic else 'pass'}"
        )
        rows = [("stage", *self.names, "switch before", "gathers", "fwd bytes/rank")]
        for step in self.steps:
            st = step.stage
            sw = ", ".join(
                f"{s.activation} {s.src}->{s.dst}"
                + (f" (async, from {s.launch_after})" if s.launch_after else "")
                for s in step.switches
            )
            ga = ", ".join(f"{g.label or g.activation}[{g.channels}]" for g in st.gathers)
            here = sum(b for (n, _, p), b in counts.items() if n == st.name and p == "forward")
            dims = []
            for a in self.names:
                if a not in st.touches:
                    dims.append(".")
                    continue
                m = step.method(a)
                dims.append(step.dim(a) + ("" if m == "local" else f" ({m})"))
            rows.append((st.name, *dims, sw or "-", ga or "-", format_bytes(here)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [header]
        for r in rows:
            cells = [f"{v:<{w}}" for v, w in zip(r[:-1], widths[:-1])]
            lines.append("  " + "  ".join(cells) + f"  {r[-1]:>{widths[-1]}}")
        lines.append(
            f"  per {'block' if self.periodic else 'pass'} on rank {rank} (batch {batch}, "
            f"{itemsize}-byte items): forward {format_bytes(fwd)}, backward {format_bytes(bwd)}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# -- policies ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """Which options a strategy gives each stage (see the module docstring).

    ``kind="dsp"``: switch freely, ``hybrid`` methods for stages that mix every dim.
    ``kind="fixed"``: keep ``dim`` (default: the longest) sharded and run stages that mix it
    with ``method``; ``layout`` is how the fixed dim is cut (``"zigzag"`` for ring_zigzag).
    """

    kind: str = "dsp"
    method: str | None = None
    dim: str | None = None
    layout: str = "contiguous"
    hybrid: tuple[str, ...] | None = None
    ulysses: int = 1

    @property
    def name(self) -> str:
        return "dsp" if self.kind == "dsp" else str(self.method)


DSP_POLICY = Policy()
DEFAULT_PRICING = Pricing()

Option = tuple[tuple[str, str], ...]  # per activation: (sharded dim, method)


def _hybrid_method(stage: MultiStage, n: int, policy: Policy) -> str | None:
    """The method DSP gives a stage that mixes every dim: forced, else the cheapest hybrid
    method of its op kind that can run it, else ``gather`` for ops without one."""
    if stage.method is not None:
        return stage.method
    names = policy.hybrid
    candidates = [
        m
        for m in methods_for(stage.op, hybrid=None if names else True)
        if (names is None or m.name in names) and m.unsupported(n, stage.heads) is None
    ]
    if candidates:
        return min(candidates, key=lambda m: m.plan_cost(n, stage.heads, causal=stage.causal)).name
    return "gather" if get_method("gather").runs(stage.op) else None


def _act_options(
    stage: MultiStage, act: str, shape: ActShape, n: int, policy: Policy
) -> list[tuple[str, str]]:
    """``(dim, method)`` options of one activation in one stage under ``policy``."""
    mixed = stage.mixed(act)
    free = [d for d in shape.dims if d not in mixed]
    touched = act in stage.touches
    if policy.kind == "fixed" and touched:
        method = get_method(str(policy.method))
        dim = policy.dim
        if dim not in mixed:
            return [(dim, policy.method if method.tensor_parallel else "local")]  # type: ignore[list-item]
        if method.runs(stage.op):
            return [(dim, method.name)]  # type: ignore[list-item]
        if policy.layout != "contiguous":  # the layout stays: gather the stage's dims whole
            return [(dim, "gather")]  # type: ignore[list-item]
        # an op the method cannot run: get the dims whole the DSP way
    if not touched:
        return [(d, "local") for d in (free or shape.dims)]
    options = [(d, "local") for d in free]
    underfilled = bool(free) and all(shape.length(d) < n for d in free)
    if not free or (stage.embed_if_underfilled and underfilled):
        method = _hybrid_method(stage, n, policy)
        if method is None:
            if not free:
                raise ValueError(
                    f"stage {stage.name!r} mixes every dim of {act!r} and op kind "
                    f"{stage.op!r} has no method that runs it over a sharded dim"
                )
        else:
            over = mixed if free else shape.dims
            if get_op_kind(stage.op).ordered:  # a scan's segments: its outermost dim only
                over = mixed[:1]
            options += [(d, method) for d in over]
    return options


def _check(
    shapes: Mapping[str, ActShape], stages: tuple[MultiStage, ...], groups
) -> tuple[str, ...]:
    if not stages:
        raise ValueError("a plan needs at least one stage")
    if not shapes:
        raise ValueError("a plan needs at least one activation")
    for group in groups:
        lengths = set()
        for key in group:
            act, _, dim = key.partition(".")
            if act not in shapes:
                raise ValueError(f"same_axis names unknown activation {act!r} in {key!r}")
            lengths.add(shapes[act].length(dim))
        if len(lengths) > 1:
            raise ValueError(
                f"same_axis group {sorted(group)} has different lengths {sorted(lengths)}"
            )
    names = tuple(shapes)
    for st in stages:
        for a in st.touches:
            if a not in shapes:
                raise ValueError(
                    f"stage {st.name!r} touches unknown activation {a!r}; known: {list(names)}"
                )
            bad = [d for d in st.mixed(a) if d not in shapes[a].dims]
            if bad:
                raise ValueError(
                    f"stage {st.name!r} mixes unknown dim(s) {bad}; the sequence dims of "
                    f"{a!r} are {shapes[a].dims}"
                )
    return names


def _axis_class(same_axis: tuple[frozenset[str], ...], activation: str, dim: str) -> str:
    key = f"{activation}.{dim}"
    for i, group in enumerate(same_axis):
        if key in group:
            return f"axis{i}"
    return key


@dataclass(frozen=True)
class PlanProblem:
    """What the planner minimises, spelled out: per stage its options (one ``(dim, method)``
    per activation), the cost of running a stage with an option, and of moving between
    options. :meth:`cost` prices any option sequence, so a test can check the planner's choice
    against brute force over the same options."""

    names: tuple[str, ...]
    options: tuple[tuple[Option, ...], ...]
    stages: tuple[MultiStage, ...]
    sp_size: int
    periodic: bool
    policy: Policy
    unit: Mapping[str, float]
    elements: Mapping[str, int]
    lengths: Mapping[str, Mapping[str, int]]
    pricing: Pricing

    @property
    def tolerance(self) -> float:
        return 1e-9 * max(1.0, sum(self.elements.values()))

    def excess(self, act: str, dim: str) -> float:
        """Elements the busiest rank holds beyond a balanced share (idle or waiting ranks)."""
        length, n = self.lengths[act][dim], self.sp_size
        if length == 0:
            return 0.0
        busiest = max(shard_sizes(length, n))
        return max(0.0, busiest * n / length - 1.0) * self.elements[act] / n

    def here(self, i: int, option: Option) -> float:
        """Cost of stage ``i`` run with ``option``: methods' bytes and lost compute."""
        st, cost = self.stages[i], 0.0
        for a, (d, m) in zip(self.names, option):
            if a not in st.touches:
                continue
            cost += self.pricing.compute_weight * self.excess(a, d)
            if m != "local":
                cost += (
                    get_method(m).plan_cost(
                        self.sp_size, st.heads, self.policy.ulysses, causal=st.causal
                    )
                    * (self.unit[a])
                )
        return cost

    def move(self, src: Option, dst: Option) -> float:
        """Cost of the switches from ``src`` to ``dst`` (leaving a gather stage is local)."""
        cost = 0.0
        for a, (s, m), (d, _) in zip(self.names, src, dst):
            if s != d and m != "gather":
                cost += 2.0 * self.unit[a]
        return cost

    @staticmethod
    def changes(src: Option, dst: Option) -> int:
        """How many activations change their sharded dim."""
        return sum(s[0] != d[0] for s, d in zip(src, dst))

    def cost(self, sequence: list[Option] | tuple[Option, ...]) -> float:
        """Total cost of one period run with ``sequence`` (cyclic when periodic)."""
        total = sum(self.here(i, c) for i, c in enumerate(sequence))
        total += sum(self.move(a, b) for a, b in zip(sequence, sequence[1:]))
        if self.periodic:
            total += self.move(sequence[-1], sequence[0])
        return total


def plan_problem(
    shapes: Mapping[str, ActShape],
    stages: Iterable[MultiStage],
    sp_size: int,
    same_axis: Iterable[Iterable[str]] = (),
    periodic: bool = True,
    policy: Policy = DSP_POLICY,
    pricing: Pricing = DEFAULT_PRICING,
) -> PlanProblem:
    """The :class:`PlanProblem` of these declarations (see :func:`plan`)."""
    shapes = dict(shapes)
    stages = tuple(stages)
    groups = tuple(frozenset(g) for g in same_axis)
    names = _check(shapes, stages, groups)
    n = sp_size
    if policy.kind == "fixed":
        first = shapes[names[0]]
        dim = policy.dim or max(first.dims, key=lambda d: (first.length(d), -first.dims.index(d)))
        if dim not in first.dims:
            raise ValueError(
                f"cannot shard unknown dim {dim!r}; the sequence dims are {first.dims}"
            )
        policy = Policy(
            policy.kind, policy.method, dim, policy.layout, policy.hybrid, policy.ulysses
        )
    options: list[tuple[Option, ...]] = []
    for st in stages:
        per_act = [_act_options(st, a, shapes[a], n, policy) for a in names]
        combos = []
        for combo in itertools.product(*per_act):
            chosen = dict(zip(names, (d for d, _ in combo)))
            if len({_axis_class(groups, a, chosen[a]) for a in st.aligned}) <= 1:
                combos.append(tuple(combo))
        if not combos:
            raise ValueError(f"stage {st.name!r}: no sharding puts {st.aligned} on one axis")
        options.append(tuple(combos))
    return PlanProblem(
        names=names,
        options=tuple(options),
        stages=stages,
        sp_size=n,
        periodic=periodic,
        policy=policy,
        unit={a: shapes[a].elements / n * (n - 1) / n for a in names},
        elements={a: shapes[a].elements for a in names},
        lengths={a: dict(zip(shapes[a].dims, shapes[a].lengths)) for a in names},
        pricing=pricing,
    )


def plan(
    shapes: Mapping[str, ActShape],
    stages: Iterable[MultiStage],
    sp_size: int,
    same_axis: Iterable[Iterable[str]] = (),
    periodic: bool = True,
    policy: Policy = DSP_POLICY,
    pricing: Pricing = DEFAULT_PRICING,
) -> MultiPlan:
    """The cheapest schedule of ``stages`` over ``shapes`` under ``policy`` (module doc).

    Raises ``ValueError`` for unknown activations or dims, same-axis dims of different
    lengths, or a stage whose constraints no option satisfies.
    """
    problem = plan_problem(shapes, stages, sp_size, same_axis, periodic, policy, pricing)
    choice = solve(problem)
    groups = tuple(frozenset(g) for g in same_axis)
    return _build(
        dict(shapes),
        problem.stages,
        groups,
        sp_size,
        periodic,
        problem.policy,
        choice,
        problem.names,
    )


def solve(problem: PlanProblem) -> list[Option]:
    """Dynamic program over the stages (cyclic when periodic): the cheapest option sequence;
    ties keep each activation where it is, then fewest switches at the wrap-around."""
    options, here, move, changes = problem.options, problem.here, problem.move, problem.changes
    periodic, tol = problem.periodic, problem.tolerance
    k = len(options)
    best = None
    for first in options[0]:
        table: list[dict[Option, float]] = [{} for _ in range(k)]
        for i in reversed(range(k)):
            for c in options[i]:
                if i == k - 1:
                    tail = move(c, first) if periodic else 0.0
                else:
                    tail = min(table[i + 1][e] + move(c, e) for e in options[i + 1])
                table[i][c] = here(i, c) + tail
        seq = [first]
        for i in range(1, k):
            prev = seq[-1]
            target = table[i - 1][prev] - here(i - 1, prev)
            ranked = sorted(
                options[i],
                key=lambda c, p=prev: (
                    abs(table[i][c] + move(p, c) - target) > tol,
                    changes(p, c),
                    table[i][c] + move(p, c),
                ),
            )
            seq.append(ranked[0])
        cost = table[0][first]
        wrap = changes(seq[-1], first) if periodic else 0
        if best is None or cost < best[0] - tol or (abs(cost - best[0]) <= tol and wrap < best[1]):
            best = (cost, wrap, seq)
    assert best is not None
    return best[2]


def _build(shapes, stages, groups, n, periodic, policy, choice, names) -> MultiPlan:
    k = len(stages)
    steps = []
    for i, st in enumerate(stages):
        prev = choice[i - 1] if (i > 0 or periodic) else choice[0]
        switches = []
        for ai, a in enumerate(names):
            (src, src_method), (dst, _) = prev[ai], choice[i][ai]
            if src == dst or src_method == "gather":
                continue
            launch = None
            for back in range(1, k + 1):
                j = i - back
                if j < 0 and not periodic:
                    break
                if a in stages[j % k].touches:
                    if back > 1:
                        launch = stages[j % k].name
                    break
            switches.append(Switch(a, src, dst, launch))
        sharded = tuple((a, d) for a, (d, _) in zip(names, choice[i]))
        methods = tuple((a, m) for a, (_, m) in zip(names, choice[i]) if m != "local")
        steps.append(MultiStep(st, sharded, tuple(switches), methods))
    return MultiPlan(
        shapes=tuple(shapes.items()),
        same_axis=groups,
        sp_size=n,
        periodic=periodic,
        steps=tuple(steps),
        strategy=policy.name,
        layout=policy.layout,
    )

"""Plans over several activations that share an axis: DSP for a two-tensor trunk.

An AlphaFold-2 Evoformer carries an MSA activation ``m`` ``[B, S, R, c_m]`` (dims ``s``, ``r``)
and a pair activation ``z`` ``[B, R, R, c_z]`` (dims ``i``, ``j``), and ``r``, ``i``, ``j`` are
the same residues. Each activation is sharded on one of its dims at a time; a stage may read
one activation and write another (the outer product mean reads ``m`` and writes ``z``) or need
an operand whole (a triangle-multiplication operand, a pair bias: all-gathered with
:func:`~dspzoo.core.comm.gather_for_local_use`, whose backward reduce-scatters).

A model declares:

* its activations and their dims (:class:`ActShape` gives lengths and channels),
* which dims of different activations are the same axis (``same_axis``: ``{"m.r", "z.i",
  "z.j"}``), so that their shards coincide rank by rank,
* its stages (:class:`MultiStage`): per activation it touches, the dims the stage mixes (needs
  whole on every rank); the activations whose sharded dims must be the same axis (``aligned``:
  a stage that reads ``m`` on ``r`` and writes ``z`` rows or columns); and the operands it
  gathers (:class:`Gather`, fixed bytes whatever the plan).

:func:`plan_multi` chooses the sharded dim of every activation at every stage, jointly, so
that the switch bytes are minimal (a switch of activation ``a`` moves ``(M_a/N)·(N−1)/N``
elements per rank); ties prefer dims ``N`` divides, dims long enough for every rank, and
switching as late as possible. For each switch it also records the last earlier stage that
touches the activation: the switch can be *launched* right after it (``switch_async``) and
overlap the stages in between, which do not touch that activation (in the Evoformer: the MSA
switch back to ``s`` overlaps the whole pair stack).

:class:`MultiParallel` runs a plan: ``to_stage`` launches the overlapped switches whose window
opens and completes the ones the stage needs; ``gather`` all-gathers an operand along an
activation's sharded dim. :meth:`MultiPlan.comm_bytes` is the exact per-rank byte count of one
period (uneven shards included), which the tracer's bytes per block must equal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import comm
from .layout import SeqSpec, shard_offset, shard_sizes
from .runtime import SeqParallel, SeqTensor
from .trace import comm_region, format_bytes

UNEVEN_COST = 1e-6  # per stage and activation sharded on a dim N does not divide (x elements)
UNDERFILLED_COST = 1e-2  # per stage and activation sharded on a dim shorter than N


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
    """One stage: the activations it touches, the dims it mixes in each, what it gathers.

    ``mixes`` maps every activation the stage reads or writes to the dims it needs whole
    (``()``: touched, token-wise). ``aligned`` lists activations whose sharded dims must be the
    same axis (see ``same_axis`` of :func:`plan_multi`).
    """

    name: str
    mixes: Mapping[str, tuple[str, ...] | str] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()
    gathers: tuple[Gather, ...] = ()

    def __post_init__(self) -> None:
        items = self.mixes.items() if isinstance(self.mixes, Mapping) else self.mixes
        norm = tuple((a, (d,) if isinstance(d, str) else tuple(d)) for a, d in items)
        object.__setattr__(self, "mixes", norm)
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
        return hash((self.name, self.mixes, self.aligned, self.gathers))


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
    """One stage of a plan: the sharded dim of every activation, the switches before it."""

    stage: MultiStage
    sharded: tuple[tuple[str, str], ...]
    switches: tuple[Switch, ...] = ()

    def dim(self, activation: str) -> str:
        """The sharded dim of ``activation`` during this stage."""
        return dict(self.sharded)[activation]


@dataclass(frozen=True)
class MultiPlan:
    """A switch schedule over several activations for one period of stages."""

    shapes: tuple[tuple[str, ActShape], ...]
    same_axis: tuple[frozenset[str], ...]
    sp_size: int
    periodic: bool
    steps: tuple[MultiStep, ...]

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
        backward), as :mod:`dspzoo.core.comm` sends them. Zero for one rank.
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
            dims = [step.dim(a) if a in st.touches else "." for a in self.names]
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


def _axis_class(same_axis: tuple[frozenset[str], ...], activation: str, dim: str) -> str:
    key = f"{activation}.{dim}"
    for i, group in enumerate(same_axis):
        if key in group:
            return f"axis{i}"
    return key


def plan_multi(
    shapes: Mapping[str, ActShape],
    stages: Iterable[MultiStage],
    sp_size: int,
    same_axis: Iterable[Iterable[str]] = (),
    periodic: bool = True,
) -> MultiPlan:
    """Choose the sharded dim of every activation at every stage (see the module doc).

    Args:
        shapes: ``{activation: ActShape}``.
        stages: one period (one block) of stages.
        sp_size: ranks in the SP group.
        same_axis: groups of ``"activation.dim"`` names that are the same axis (equal lengths).
        periodic: the stages repeat (the last is followed by the first).

    Raises ``ValueError`` for unknown activations or dims, same-axis dims of different lengths,
    or a stage whose constraints no sharding satisfies.
    """
    shapes = dict(shapes)
    stages = tuple(stages)
    if not stages:
        raise ValueError("plan_multi needs at least one stage")
    if not shapes:
        raise ValueError("plan_multi needs at least one activation")
    groups = tuple(frozenset(g) for g in same_axis)
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
    total = sum(s.positions() * s.channels for s in shapes.values())

    options: list[list[tuple[str, ...]]] = []
    for st in stages:
        for a in st.touches:
            if a not in shapes:
                raise ValueError(
                    f"stage {st.name!r} touches unknown activation {a!r}; known: {list(names)}"
                )
            bad = [d for d in st.mixed(a) if d not in shapes[a].dims]
            if bad:
                raise ValueError(
                    f"stage {st.name!r} mixes unknown dim(s) {bad} of {a!r} {shapes[a].dims}"
                )
        per_act = []
        for a in names:
            free = [d for d in shapes[a].dims if d not in st.mixed(a)]
            if not free:
                raise ValueError(
                    f"stage {st.name!r} mixes every dim of {a!r}; no DSP sharding can run it locally"
                )
            per_act.append(free)
        combos = []
        for combo in itertools.product(*per_act):
            chosen = dict(zip(names, combo))
            classes = {_axis_class(groups, a, chosen[a]) for a in st.aligned}
            if len(classes) <= 1:
                combos.append(tuple(combo))
        if not combos:
            raise ValueError(f"stage {st.name!r}: no sharding puts {st.aligned} on one axis")
        options.append(combos)

    def here_cost(i: int, combo: tuple[str, ...]) -> float:
        cost = 0.0
        for a, d in zip(names, combo):
            if a not in stages[i].touches:
                continue
            length = shapes[a].length(d)
            if length < sp_size:
                cost += UNDERFILLED_COST * total
            elif length % sp_size:
                cost += UNEVEN_COST * total
        return cost

    def move_cost(src: tuple[str, ...], dst: tuple[str, ...]) -> float:
        return sum(
            shapes[a].positions() * shapes[a].channels for a, s, d in zip(names, src, dst) if s != d
        )

    k = len(stages)
    best: tuple[tuple[float, int], list[tuple[str, ...]]] | None = None
    for first in options[0]:
        table: list[dict[tuple[str, ...], float]] = [{} for _ in range(k)]
        for i in reversed(range(k)):
            for c in options[i]:
                if i == k - 1:
                    tail = move_cost(c, first) if periodic else 0.0
                else:
                    tail = min(table[i + 1][e] + move_cost(c, e) for e in options[i + 1])
                table[i][c] = here_cost(i, c) + tail
        choice = [first]
        for i in range(1, k):
            prev = choice[-1]
            target = table[i - 1][prev] - here_cost(i - 1, prev)
            # prefer keeping each activation where it is (switch as late as possible)
            ranked = sorted(
                options[i],
                key=lambda c, p=prev: (
                    abs(table[i][c] + move_cost(p, c) - target) > 1e-9 * max(1.0, total),
                    sum(x != y for x, y in zip(c, p)),
                    table[i][c] + move_cost(p, c),
                ),
            )
            choice.append(ranked[0])
        cost = table[0][first]
        # equal cost: fewest switches at the wrap-around into the first stage (switch late)
        wrap = sum(x != y for x, y in zip(choice[-1], first)) if periodic else 0
        key = (cost, wrap)
        if (
            best is None
            or key[0] < best[0][0] - 1e-9 * max(1.0, total)
            or (abs(key[0] - best[0][0]) <= 1e-9 * max(1.0, total) and wrap < best[0][1])
        ):
            best = (key, choice)
    assert best is not None
    choice = best[1]

    steps = []
    for i, st in enumerate(stages):
        prev = choice[i - 1] if (i > 0 or periodic) else choice[0]
        switches = []
        for ai, a in enumerate(names):
            if prev[ai] == choice[i][ai]:
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
            switches.append(Switch(a, prev[ai], choice[i][ai], launch))
        steps.append(MultiStep(st, tuple(zip(names, choice[i])), tuple(switches)))
    return MultiPlan(
        shapes=tuple(shapes.items()),
        same_axis=groups,
        sp_size=sp_size,
        periodic=periodic,
        steps=tuple(steps),
    )


# -- runtime ----------------------------------------------------------------------------------
class MultiState:
    """The activations of a planned region, by name, plus switches still in flight."""

    def __init__(self, acts: Mapping[str, SeqTensor]) -> None:
        self.acts: dict[str, SeqTensor] = dict(acts)
        self.pending: dict[str, tuple[Any, SeqSpec]] = {}

    def __getitem__(self, name: str) -> SeqTensor:
        if name in self.pending:
            raise RuntimeError(
                f"activation {name!r} is being switched; call to_stage for a stage that uses it"
            )
        return self.acts[name]

    def __setitem__(self, name: str, act: SeqTensor) -> None:
        self.acts[name] = act


class MultiParallel:
    """Runs a :class:`MultiPlan` on an SP group (``sp``'s).

    Args:
        sp: the sequence-parallel context (its group and rank).
        plan: the plan to run.
        switch_chunk: in no-grad mode, switch in pieces of at most this many channels into a
            preallocated output (bounds the send/receive buffers for long proteins; same bytes).
    """

    def __init__(self, sp: SeqParallel, plan: MultiPlan, switch_chunk: int | None = None) -> None:
        if plan.sp_size != sp.size:
            raise ValueError(f"plan for SP size {plan.sp_size} run on a group of {sp.size}")
        self.sp, self.plan, self.switch_chunk = sp, plan, switch_chunk
        self._order = [s.stage.name for s in plan.steps]

    # -- layout helpers -----------------------------------------------------------------------
    def spec(self, activation: str, dim: str | None, first_axis: int = 1) -> SeqSpec:
        """The spec of ``activation`` sharded on ``dim``."""
        shp = self.plan.shape(activation)
        return SeqSpec(shp.dims, shp.lengths, first_axis=first_axis, sharded=dim)

    def local_range(self, spec: SeqSpec, dim: str) -> tuple[int, int]:
        """``(offset, size)`` of this rank's rows of ``dim`` under ``spec`` (whole if unsharded)."""
        if spec.sharded != dim or self.sp.size == 1:
            return 0, spec.length(dim)
        length = spec.length(dim)
        return (
            shard_offset(length, self.sp.size, self.sp.rank),
            shard_sizes(length, self.sp.size)[self.sp.rank],
        )

    def enter(self, local: Mapping[str, torch.Tensor]) -> MultiState:
        """Local shards (already cut on the plan's entry dims) → a :class:`MultiState`."""
        acts = {}
        for name in self.plan.names:
            spec = self.spec(name, self.plan.entry(name))
            spec.check_local(local[name], self.sp.rank, self.sp.size)
            acts[name] = SeqTensor(local[name], spec)
        return MultiState(acts)

    # -- stages ------------------------------------------------------------------------------
    def to_stage(self, state: MultiState, stage: str) -> MultiState:
        """Launch the overlapped switches whose window opens here; finish those ``stage`` needs."""
        step = self.plan.step_for(stage)
        previous = self._order[self._order.index(stage) - 1]
        for target, sw in self.plan.launches_after(previous):
            if sw.activation in state.pending or state.acts[sw.activation].spec.sharded != sw.src:
                continue
            with comm_region(f"{target}-async"):
                act = state.acts[sw.activation]
                handle = comm.switch_async(
                    act.tensor,
                    act.axis(sw.src),
                    act.axis(sw.dst),
                    self.sp.group,
                    act.spec.length(sw.src),
                )
            state.pending[sw.activation] = (handle, act.spec.with_sharded(sw.dst))
            del state.acts[sw.activation]
        for name in step.stage.touches:
            self._settle(state, name)
            want = step.dim(name)
            if state.acts[name].spec.sharded != want:
                state.acts[name] = self.switch(state.acts[name], want)
        return state

    def _settle(self, state: MultiState, name: str) -> None:
        if name in state.pending:
            handle, spec = state.pending.pop(name)
            state.acts[name] = SeqTensor(handle.wait(), spec)

    def switch(self, act: SeqTensor, dim: str) -> SeqTensor:
        """Re-shard ``act`` on ``dim`` (chunked over channels in no-grad mode if configured)."""
        src = act.spec.sharded
        if src == dim:
            return act
        if src is None or self.sp.size == 1:
            return SeqTensor(act.tensor, act.spec.with_sharded(dim))
        a, b, length = act.axis(src), act.axis(dim), act.spec.length(src)
        x = act.tensor
        chunk = self.switch_chunk
        if torch.is_grad_enabled() or chunk is None or x.shape[-1] <= chunk:
            out = comm.switch(x, a, b, self.sp.group, length)
        else:
            shape = list(x.shape)
            shape[a], shape[b] = length, shard_sizes(x.shape[b], self.sp.size)[self.sp.rank]
            out = x.new_empty(shape)
            for c0 in range(0, x.shape[-1], chunk):
                part = x[..., c0 : c0 + chunk]
                out[..., c0 : c0 + chunk] = comm.switch(part, a, b, self.sp.group, length)
        return SeqTensor(out, act.spec.with_sharded(dim))

    def gather(
        self, t: torch.Tensor, spec: SeqSpec, dim: str | None = None, first_axis: int | None = None
    ) -> torch.Tensor:
        """All-gather ``t`` (laid out like ``spec``) along ``spec``'s sharded dim, for local use.

        ``t`` may have other channels than the activation. Backward: reduce-scatter. ``dim``
        (default ``spec.sharded``) and ``first_axis`` (default ``spec.first_axis``) locate the
        axis in ``t``.
        """
        dim = spec.sharded if dim is None else dim
        if dim is None or spec.sharded != dim or self.sp.size == 1:
            return t
        first = spec.first_axis if first_axis is None else first_axis
        axis = first + spec.names.index(dim)
        return comm.gather_for_local_use(t, axis, self.sp.group, spec.length(dim))

    def finish(self, state: MultiState) -> MultiState:
        """Wait for every switch still in flight (the activations stay sharded)."""
        for name in list(state.pending):
            self._settle(state, name)
        return state

    def exit(self, state: MultiState, name: str) -> torch.Tensor:
        """The full (replicated) tensor of activation ``name``; finishes pending switches."""
        self.finish(state)
        return self.sp.exit(state.acts[name])

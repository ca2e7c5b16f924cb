"""Single-activation stage declarations and plans: the one-activation case of the planner.

A model declares its sequence dims and, for each computation stage, the dims it *mixes*
(needs whole) and what it computes there (``op``: ``"attention"``, ``"generic"`` for a
convolution, pooling or any op that needs its dims whole, or a registered kind). Under DSP a
stage runs locally when the sharded dim is one it does not mix; a switch (one all-to-all)
moves the sharding between stages that need different dims. Stages usually repeat (one
transformer layer after another): plans are periodic by default and count the switch from
the last stage back to the first.

A plan says, per stage, the sharded dim **and the method** that runs the stage (``local``, an
embedded method such as ``ulysses`` or ``ring`` for a stage whose attention mixes the sharded
dim, ``gather`` for a generic op that mixes every dim, ``megatron_sp`` on every stage under
tensor parallelism). The choice and its costs are the planner's
(:mod:`dspzoo.core.parallel.planner`), priced from the method registry
(:mod:`dspzoo.core.parallel.methods.registry`); this module only declares and presents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .methods.registry import METHODS, get_method, get_op_kind
from .planner import DEFAULT_PRICING, DSP_POLICY, ActShape, MultiPlan, MultiStage, Policy, Pricing
from .planner import plan as plan_activations

# names kept for code written against the earlier API: both lists are read from the registry
EMBEDDED_METHODS = tuple(
    m.name
    for m in METHODS.values()
    if m.entry and not m.tensor_parallel and m.layout == "contiguous"
)
TENSOR_PARALLEL_METHODS = tuple(m.name for m in METHODS.values() if m.tensor_parallel)

_ACT = "x"  # the one activation of a single-activation plan


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
    ``op`` says what the stage computes over the dims it mixes: ``"attention"`` (the default,
    run through ``sp.attention``), ``"generic"`` (a convolution, pooling, an FFT, a custom
    mixer: it always gets its dims whole, by a switch or a gather, under every strategy) or a
    registered kind (:func:`~dspzoo.core.parallel.methods.registry.register_op_kind`).
    ``causal``: the stage's attention is causal, so the planner prices a method by what it
    sends under a causal mask (``ring_balanced``'s busiest rank sends 0.51–0.63× ring's there).
    """

    name: str
    mixes: tuple[str, ...] = ()
    method: str | None = None
    heads: int | None = None
    embed_if_underfilled: bool = False
    op: str = "attention"
    causal: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.mixes, str):
            object.__setattr__(self, "mixes", (self.mixes,))
        get_op_kind(self.op)
        if self.method is not None and self.method not in EMBEDDED_METHODS:
            raise ValueError(
                f"stage {self.name!r}: method must be one of {list(EMBEDDED_METHODS)}, got "
                f"{self.method!r}"
            )
        if self.method is not None and not get_method(self.method).runs(self.op):
            raise ValueError(
                f"stage {self.name!r}: method {self.method!r} does not run {self.op!r} ops"
            )

    def as_multi(self) -> MultiStage:
        """This stage as the one-activation case of the planner's :class:`MultiStage`."""
        return MultiStage(
            self.name,
            {_ACT: self.mixes},
            op=self.op,
            method=self.method,
            heads=self.heads,
            embed_if_underfilled=self.embed_if_underfilled,
            causal=self.causal,
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
            f"{self.switches_per_period} switch(es) per {'layer' if self.periodic else 'pass'}, entry split on {self.entry!r}"
            + (" (one process: the switches move nothing)" if self.sp_size == 1 else ""),
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


def _note(dim: str, length: int, sp_size: int) -> str:
    if length < sp_size:
        return f"{dim}={length} < SP size {sp_size}: some ranks idle"
    if length % sp_size:
        return f"{dim}={length} not divisible by {sp_size}: uneven shards"
    return ""


def plan_from_multi(multi: MultiPlan) -> Plan:
    """The single-activation :class:`Plan` view of a one-activation :class:`MultiPlan`."""
    ((act, shape),) = multi.shapes
    lengths = dict(zip(shape.dims, shape.lengths))
    steps = []
    for step in multi.steps:
        dim = step.dim(act)
        steps.append(
            PlanStep(
                step.stage.name,
                step.stage.mixed(act),
                dim,
                step.switches[0].src if step.switches else None,
                _note(dim, lengths[dim], multi.sp_size),
                step.method(act),
            )
        )
    return Plan(
        dims=shape.dims,
        lengths=shape.lengths,
        sp_size=multi.sp_size,
        periodic=multi.periodic,
        steps=tuple(steps),
        strategy=multi.strategy,
        layout=multi.layout,
    )


def _single(
    dims: tuple[str, ...],
    lengths: tuple[int, ...],
    stages: tuple[Stage, ...] | list[Stage],
    sp_size: int,
    periodic: bool,
    policy: Policy,
    pricing: Pricing,
) -> Plan:
    dims, lengths, stages = tuple(dims), tuple(lengths), tuple(stages)
    if len(dims) != len(lengths):
        raise ValueError(f"{len(dims)} dims {dims} but {len(lengths)} lengths {lengths}")
    if not stages:
        raise ValueError("a plan needs at least one stage")
    shapes = {_ACT: ActShape(dims, lengths, 1)}
    multi = plan_activations(
        shapes, [s.as_multi() for s in stages], sp_size, (), periodic, policy, pricing
    )
    return plan_from_multi(multi)


def plan_stages(
    dims: tuple[str, ...],
    lengths: tuple[int, ...],
    stages: tuple[Stage, ...] | list[Stage],
    sp_size: int,
    periodic: bool = True,
    pricing: Pricing = DEFAULT_PRICING,
) -> Plan:
    """DSP's plan: the sharded dim of every stage, switching between stages as needed.

    Args:
        dims: sequence dim names, e.g. ``("t", "h", "w")``.
        lengths: their global lengths.
        stages: the stage sequence of one period (one layer) or of the whole model.
        sp_size: ranks in the SP group.
        periodic: the stages repeat, so the last stage is followed by the first.

    The one-activation case of :func:`dspzoo.core.parallel.planner.plan` under the DSP policy: a stage
    that mixes every dim runs with the cheapest hybrid method of its op kind (``Stage.method``
    forces one; a generic op is gathered whole), and the plan becomes a hybrid. Raises
    ``ValueError`` for unknown dims.
    """
    return _single(dims, lengths, stages, sp_size, periodic, DSP_POLICY, pricing)


def plan_fixed(
    dims: tuple[str, ...],
    lengths: tuple[int, ...],
    stages: tuple[Stage, ...] | list[Stage],
    sp_size: int,
    method: str,
    dim: str | None = None,
    periodic: bool = True,
    layout: str = "contiguous",
    pricing: Pricing = DEFAULT_PRICING,
) -> Plan:
    """The plan of a fixed-dim embedded strategy: one dim sharded throughout.

    Every stage that mixes the sharded ``dim`` runs with ``method`` when the method runs the
    stage's op kind; a stage it cannot run (a convolution under Ring) gets its dims whole by a
    switch, as DSP would. A tensor-parallel ``method`` (``megatron_sp``) is put in force on
    *every* stage. ``dim`` defaults to the longest dim (ties: the first).
    ``layout="zigzag"`` (ring only) cuts the dim into ``2N`` chunks, rank ``r`` holding chunks
    ``r`` and ``2N−1−r``, which balances causal attention's work over the ring.
    """
    chosen = get_method(method)
    if layout == "zigzag" and method == "ring":
        chosen = get_method("ring_zigzag")
    if not chosen.entry or chosen.name in ("local", "switch", "gather"):
        raise ValueError(
            f"method must be one of {[*EMBEDDED_METHODS, *TENSOR_PARALLEL_METHODS]}, got {method!r}"
        )
    if layout != chosen.layout:
        raise ValueError(f"layout {layout!r} is not available with method {method!r}")
    if dim is not None and dim not in dims:
        raise ValueError(f"cannot shard unknown dim {dim!r}; the sequence dims are {tuple(dims)}")
    policy = Policy("fixed", chosen.name, dim, chosen.layout)
    return _single(dims, lengths, stages, sp_size, periodic, policy, pricing)

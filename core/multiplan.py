"""Plans over several activations that share an axis, and running them: DSP for a two-tensor
trunk.

An AlphaFold-2 Evoformer carries an MSA activation ``m`` ``[B, S, R, c_m]`` (dims ``s``, ``r``)
and a pair activation ``z`` ``[B, R, R, c_z]`` (dims ``i``, ``j``), and ``r``, ``i``, ``j`` are
the same residues. Each activation is sharded on one of its dims at a time; a stage may read
one activation and write another (the outer product mean reads ``m`` and writes ``z``) or need
an operand whole (a triangle-multiplication operand, a pair bias: all-gathered with
:func:`~dspzoo.core.comm.gather_for_local_use`, whose backward reduce-scatters).

The declarations (:class:`ActShape`, :class:`MultiStage`, :class:`Gather`) and the plan
(:class:`MultiPlan`) are the one planner's (:mod:`dspzoo.core.planner`), which also plans
single-activation models; :func:`plan_multi` is its DSP policy. For each switch the plan
records the last earlier stage that touches the activation: the switch can be *launched*
right after it (``switch_async``) and overlap the stages in between (in the Evoformer: the
MSA switch back to ``s`` overlaps the whole pair stack).

:class:`MultiParallel` runs such a plan on the one runtime (:class:`SeqParallel`'s switches,
asynchronous and chunked): ``to_stage`` launches the overlapped switches whose window opens
and completes the ones the stage needs; ``gather`` all-gathers an operand along an
activation's sharded dim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import comm
from .layout import SeqSpec, shard_offset, shard_sizes
from .planner import (
    DEFAULT_PRICING,
    ActShape,
    Gather,
    MultiPlan,
    MultiStage,
    MultiStep,
    Policy,
    Pricing,
    Switch,
)
from .planner import plan as _plan
from .runtime import SeqParallel, SeqTensor
from .trace import comm_region

__all__ = [
    "ActShape",
    "Gather",
    "MultiParallel",
    "MultiPlan",
    "MultiStage",
    "MultiState",
    "MultiStep",
    "Switch",
    "plan_multi",
]


# several activations run their stages locally (MultiParallel has no embedded kernels): a
# stage that mixes every dim of an activation is refused unless its op is gathered whole
MULTI_DSP = Policy(hybrid=())


def plan_multi(
    shapes: Mapping[str, ActShape],
    stages: Iterable[MultiStage],
    sp_size: int,
    same_axis: Iterable[Iterable[str]] = (),
    periodic: bool = True,
    pricing: Pricing = DEFAULT_PRICING,
) -> MultiPlan:
    """DSP's plan over several activations (see :func:`dspzoo.core.planner.plan`).

    Args:
        shapes: ``{activation: ActShape}``.
        stages: one period (one block) of stages.
        sp_size: ranks in the SP group.
        same_axis: groups of ``"activation.dim"`` names that are the same axis (equal lengths).
        periodic: the stages repeat (the last is followed by the first).
    """
    return _plan(shapes, stages, sp_size, same_axis, periodic, MULTI_DSP, pricing)


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
                state.pending[sw.activation] = self.sp.switch_async(
                    state.acts[sw.activation], sw.dst
                )
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
        out = self.sp._switch_tensor(act.tensor, a, b, length, self.switch_chunk)
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

"""Plans over several activations that share an axis, and running them: DSP for a two-tensor
trunk.

An AlphaFold-2 Evoformer carries an MSA activation ``m`` ``[B, S, R, c_m]`` (dims ``s``, ``r``)
and a pair activation ``z`` ``[B, R, R, c_z]`` (dims ``i``, ``j``), and ``r``, ``i``, ``j`` are
the same residues. Each activation is sharded on one of its dims at a time; a stage may read
one activation and write another (the outer product mean reads ``m`` and writes ``z``) or need
an operand whole (a triangle-multiplication operand, a pair bias: all-gathered with
:func:`~dspzoo.core.parallel.comm.gather_for_local_use`, whose backward reduce-scatters).

The declarations (:class:`ActShape`, :class:`MultiStage`, :class:`Gather`) and the plan
(:class:`MultiPlan`) are the one planner's (:mod:`dspzoo.core.parallel.planner`), which also plans
single-activation models; :func:`plan_multi` is its DSP policy. For each switch the plan
records the last earlier stage that touches the activation: the switch can be *launched*
right after it (``switch_async``) and overlap the stages in between (in the Evoformer: the
MSA switch back to ``s`` overlaps the whole pair stack).

:class:`MultiParallel` runs such a plan on the one runtime (:class:`SeqParallel`'s switches,
asynchronous and chunked): ``to_stage`` launches the overlapped switches whose window opens
and completes the ones the stage needs; ``gather`` all-gathers an operand along an
activation's sharded dim. ``mp.region(m=..., z=...)`` opens the region for plain-tensor blocks
(:mod:`dspzoo.core.parallel.context`): ``m, z = stage("msa_row", m=m, z=z)`` does all of that, layers
ask ``gather_for_local_use(t, "z")`` and ``local(mask, "m")``, and each stage's collectives are
traced under the stage's name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from . import comm
from .context import Region, check_local_shape, open_region
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
from .runtime import SeqParallel, SeqTensor, agreed_call
from .trace import comm_region, tag_stage

__all__ = [
    "ActShape",
    "Gather",
    "MultiParallel",
    "MultiPlan",
    "MultiStage",
    "MultiState",
    "MultiStep",
    "SeveralActivations",
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
    """DSP's plan over several activations (see :func:`dspzoo.core.parallel.planner.plan`).

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

    def agree_entry(self, **inputs: torch.Tensor) -> None:
        """The forward's one agreement (:meth:`SeqParallel.agree_entry`) on the replicated
        ``inputs`` and this plan, when the model has not made it yet; call it before the
        first collective of the forward."""
        if not self.sp._fresh:
            self.sp.agree_entry(inputs, ("several activations", self.plan))

    @contextmanager
    def region(self, **local: torch.Tensor) -> Iterator[SeveralActivations]:
        """Open the region of the activations whose local shards (cut on the plan's entry dims)
        are given by name, for plain-tensor blocks (see :class:`SeveralActivations`)."""
        with open_region(SeveralActivations(self, self.enter(local))) as region:
            yield region

    def enter(self, local: Mapping[str, torch.Tensor]) -> MultiState:
        """Local shards (already cut on the plan's entry dims) → a :class:`MultiState`."""
        acts = {}
        for name in self.plan.names:
            spec = self.spec(name, self.plan.entry(name))
            spec.check_local(local[name], self.sp.rank, self.sp.size)
            acts[name] = SeqTensor(local[name], spec)
        return MultiState(acts)

    # -- stages ------------------------------------------------------------------------------
    @agreed_call
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

    @agreed_call
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

    @agreed_call
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

    @agreed_call
    def finish(self, state: MultiState) -> MultiState:
        """Wait for every switch still in flight (the activations stay sharded)."""
        for name in list(state.pending):
            self._settle(state, name)
        return state

    @agreed_call
    def exit(self, state: MultiState, name: str) -> torch.Tensor:
        """The full (replicated) tensor of activation ``name``; finishes pending switches."""
        self.finish(state)
        return self.sp.exit(state.acts[name])


class SeveralActivations(Region):
    """The region of several activations (``mp.region(m=..., z=...)``).

    :meth:`stage` takes the local tensors by name (``m, z = stage("msa_row", m=m, z=z)``) and
    runs :meth:`MultiParallel.to_stage`. A switch the plan overlaps with later stages
    (``switch_async``) is launched from the tensor last passed for its activation; until a
    stage that needs the activation completes it, that activation is "in flight": passing a
    different tensor for it raises, and :meth:`spec` / :meth:`local` of it raise.
    """

    def __init__(self, mp: MultiParallel, state: MultiState) -> None:
        self.sp, self.mp, self.state = mp.sp, mp, state
        self._sent: dict[str, torch.Tensor] = {}  # what each in-flight switch was launched from
        self._tag: tuple[str, ...] | None = None
        self._unavailable: frozenset[str] = frozenset()  # a snapshot's in-flight activations

    def snapshot(self) -> SeveralActivations:
        """A copy with its own activations' record (a stage updates the state in place).

        An activation whose overlapped switch is in flight when the checkpointed unit starts
        is *unavailable* in the copy: a unit that does not touch it (an Evoformer pair layer
        while the MSA switches back) recomputes exactly; one that asks for it (its layout, a
        stage) raises, since its recomputation could not relaunch a switch its forward did
        not (checkpoint units the plan does not overlap across)."""
        copied = copy.copy(self)
        copied.state = MultiState(
            {n: a for n, a in self.state.acts.items() if n not in self.state.pending}
        )
        copied._sent = {}
        copied._unavailable = self._unavailable | frozenset(self.state.pending)
        return copied

    def _check_available(self, act: str, what: str) -> None:
        if act in self._unavailable:
            raise RuntimeError(
                f"activation checkpointing: {what} needs activation {act!r}, which was being "
                f"switched (an overlapped switch) when this checkpointed unit began, so its "
                f"recomputation cannot have it; checkpoint units the plan does not overlap "
                f"across (smaller ones, e.g. the layers of a block: sublayer_units)"
            )

    # -- stages --------------------------------------------------------------------------------
    def stage(
        self, name: str, x: torch.Tensor | None, acts: dict[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if x is not None or not acts:
            first = self.mp.plan.names[0]
            raise TypeError(
                f"stage({name!r}): this region carries the activations {list(self.mp.plan.names)}; "
                f"name the ones the block holds, e.g. {first} = stage({name!r}, {first}={first})"
            )
        for act in self.mp.plan.names:  # the stage's switches may touch any of them
            self._check_available(act, f"stage({name!r})")
        for act, t in acts.items():
            self._put(act, t, f"stage({name!r})")
        self._tag = tag_stage(name, self._tag)
        before = {act: held.tensor for act, held in self.state.acts.items()}
        self.mp.to_stage(self.state, name)
        for act in self.state.pending:
            self._sent.setdefault(act, before.get(act))
        for act in [a for a in self._sent if a not in self.state.pending]:
            del self._sent[act]
        self.stage_name = name
        out = tuple(self._get(act) for act in acts)
        return out[0] if len(out) == 1 else out

    def _known(self, act: str | None, what: str) -> str:
        names = self.mp.plan.names
        if act is None and len(names) == 1:
            return names[0]
        if act not in names:
            raise ValueError(
                f"{what}: name one of this region's activations {list(names)}, got {act!r}"
            )
        return act

    def _put(self, act: str, t: torch.Tensor, what: str) -> None:
        act = self._known(act, what)
        if act in self.state.pending:
            if t is not self._sent[act]:
                raise RuntimeError(
                    f"{what}: activation {act!r} was replaced after the plan launched its switch "
                    f"(overlapped with the stages before one that needs it); a block must not "
                    f"update {act!r} between its last stage and the next stage that touches it"
                )
            return
        spec = self.state.acts[act].spec
        check_local_shape(t, spec, self.sp.rank, self.sp.size, f"{what}, activation {act!r}")
        self.state.acts[act] = SeqTensor(t, spec)

    def _get(self, act: str) -> torch.Tensor:
        return self._sent[act] if act in self.state.pending else self.state.acts[act].tensor

    def seq(self, act: str, t: torch.Tensor) -> SeqTensor:
        """The local tensor ``t`` of ``act`` as a SeqTensor, its in-flight switch completed."""
        self._check_available(act, "region.seq")
        self._put(act, t, "region.seq")
        self.mp._settle(self.state, act)
        self._sent.pop(act, None)
        return self.state.acts[act]

    # -- what layers ask ------------------------------------------------------------------------
    def spec(self, act: str | None = None) -> SeqSpec:
        act = self._known(act, "layout")
        self._check_available(act, "layout")
        if act in self.state.pending:
            raise RuntimeError(
                f"activation {act!r} is being switched (overlapped); use it in a stage that "
                f"touches it, after stage(..., {act}={act})"
            )
        return self.state.acts[act].spec

    def wrap(self, t: torch.Tensor, act: str | None = None) -> SeqTensor:
        return SeqTensor(t, self.spec(act))

    def activation_with(self, dims: tuple[str, ...]) -> str | None:
        found = [n for n in self.mp.plan.names if set(dims) <= set(self.mp.plan.shape(n).dims)]
        if len(found) != 1:
            raise ValueError(
                f"name the activation: dims {dims} belong to {found or 'none'} of "
                f"{list(self.mp.plan.names)}"
            )
        return found[0]

    def local(self, t: torch.Tensor, act: str | None, axes: dict[str, int] | None) -> torch.Tensor:
        spec = self.spec(act)
        dim = spec.sharded
        if dim is None or self.sp.size == 1:
            return t
        if axes is None and t.dim() < spec.first_axis + len(spec.names):
            return t
        axis = spec.axis(dim) if axes is None else axes.get(dim)
        if axis is None or (t.shape[axis] == 1 and spec.length(dim) != 1):  # broadcasts
            return t
        if t.shape[axis] != spec.length(dim):
            raise ValueError(
                f"local: axis {axis} of a tensor of shape {tuple(t.shape)} has size "
                f"{t.shape[axis]}, but dim {dim!r} of {act!r} has length {spec.length(dim)} "
                f"(or 1 to broadcast)"
            )
        offset, size = self.mp.local_range(spec, dim)
        return t.narrow(axis, offset, size)

    def gather_for_local_use(self, t: torch.Tensor, act: str | None = None) -> torch.Tensor:
        return self.mp.gather(t, self.spec(act))

    # -- end -------------------------------------------------------------------------------------
    def close(self) -> None:
        self.mp.finish(self.state)
        self._sent.clear()
        super().close()

    def release(self) -> None:
        self._tag = tag_stage(None, self._tag)
        super().release()

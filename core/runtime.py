"""The runtime a model talks to: sharded activations and the SP context.

A model is written once, as if on one device, in terms of stages::

    act = sp.enter(x, names=("t", "s"), stages=STAGES)   # split on the planned dim
    for block in blocks:
        act = sp.to_stage(act, "spatial")                # switch if the plan says so
        h = sp.attention(q, k, v, act.spec, over="s")    # attention over a whole dim
        ...
    out = sp.exit(act)                                   # gather (or keep sharded for the loss)

:class:`SeqTensor` carries the local tensor together with its :class:`~dspzoo.core.layout.SeqSpec`
(names, true lengths, sharded dim, the method in force) and the plan, so the sharding state is
explicit and travels with the data. The strategy is a planning policy chosen at run time
(``dsp``, ``ulysses``, ``ring``, ``lss``, ``usp``): the plan names, per stage, the sharded dim
and the method, and this runtime executes any plan the same way — ``to_stage`` switches and
sets the method, ``attention`` runs locally or through the method.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from . import comm
from .layout import SeqSpec
from .mesh import SPMesh
from .plan import Plan, Stage
from .strategies.base import Strategy
from .trace import comm_region


@dataclass(frozen=True)
class SeqTensor:
    """A local tensor plus the sharding state of the activation it belongs to.

    Attributes:
        tensor: this rank's data, e.g. ``[B, T_local, S, C]`` when sharded on ``t``.
        spec: names, true global lengths and the sharded dim.
        plan: the stage plan in force (``None`` outside a planned region).
    """

    tensor: torch.Tensor
    spec: SeqSpec
    plan: Plan | None = None

    def with_tensor(self, tensor: torch.Tensor) -> SeqTensor:
        """Same sharding, new local data (sequence axes must keep their local sizes)."""
        first, count = self.spec.first_axis, len(self.spec.names)
        if tuple(tensor.shape[first : first + count]) != tuple(
            self.tensor.shape[first : first + count]
        ):
            raise ValueError(
                f"with_tensor: sequence axes {self.spec.names} changed from "
                f"{tuple(self.tensor.shape[first : first + count])} to {tuple(tensor.shape[first : first + count])}"
            )
        return replace(self, tensor=tensor)

    def axis(self, name: str) -> int:
        """Tensor axis of sequence dim ``name``."""
        return self.spec.axis(name)


class SeqParallel:
    """Sequence-parallel context of one SP group, handed to a model's ``forward``.

    Args:
        mesh: the dp × sp mesh (or ``None`` for a single process).
        strategy: a name from :data:`dspzoo.core.strategies.STRATEGIES` (``"dsp"``,
            ``"ulysses"``, ``"ring"``, ``"lss"``, ``"usp"``) or a :class:`Strategy` instance.
        dim: for an embedded strategy, the sequence dim to shard (default: the longest).
    """

    def __init__(
        self,
        mesh: SPMesh | None = None,
        strategy: str | Strategy = "dsp",
        dim: str | None = None,
    ) -> None:
        from .strategies import get_strategy

        self.mesh = mesh
        self.group: Any = None if mesh is None else mesh.sp_group
        self.size = comm.group_size(self.group)
        self.rank = comm.group_rank(self.group)
        self.strategy = get_strategy(strategy, dim) if isinstance(strategy, str) else strategy
        self._plans: dict[tuple, Plan] = {}

    def __repr__(self) -> str:
        return f"SeqParallel(size={self.size}, rank={self.rank}, strategy={self.strategy.name!r})"

    # -- planning ---------------------------------------------------------------------------
    def plan(
        self, names: tuple[str, ...], lengths: tuple[int, ...], stages: tuple[Stage, ...]
    ) -> Plan:
        """The (cached) plan for these dims, lengths and stages at this group's size."""
        key = (tuple(names), tuple(lengths), tuple(stages))
        if key not in self._plans:
            self._plans[key] = self.strategy.plan(
                tuple(names), tuple(lengths), tuple(stages), self.size
            )
        return self._plans[key]

    # -- entering and leaving the sharded region --------------------------------------------
    def enter(
        self,
        x: torch.Tensor,
        names: tuple[str, ...],
        stages: tuple[Stage, ...],
        first_axis: int = 1,
    ) -> SeqTensor:
        """Replicated ``x`` → :class:`SeqTensor` sharded on the plan's entry dim."""
        spec = SeqSpec.of(x, tuple(names), first_axis)
        plan = self.plan(spec.names, spec.lengths, tuple(stages))
        return self.shard(x, spec, plan.entry, plan)

    def shard(
        self, x: torch.Tensor, spec: SeqSpec, dim: str, plan: Plan | None = None
    ) -> SeqTensor:
        """Replicated ``x`` described by ``spec`` → sharded on ``dim`` (in the plan's layout)."""
        layout = "contiguous" if plan is None else plan.layout
        spec = replace(spec.with_sharded(dim), layout=layout)
        return SeqTensor(self._split(x, spec.axis(dim), layout), spec, plan)

    def _split(self, t: torch.Tensor, axis: int, layout: str) -> torch.Tensor:
        if layout == "zigzag" and self.size > 1:
            from .methods.ring import zigzag_split

            return zigzag_split(t, axis, self.group)
        return comm.split(t, axis, self.group)

    def exit(self, act: SeqTensor) -> torch.Tensor:
        """Sharded :class:`SeqTensor` → replicated tensor (identical use on every rank)."""
        spec = act.spec
        if spec.sharded is None:
            return act.tensor
        axis, length = spec.axis(spec.sharded), spec.length(spec.sharded)
        with comm_region("exit"):
            if spec.layout == "zigzag" and self.size > 1:
                from .methods.ring import zigzag_gather

                return zigzag_gather(act.tensor, axis, self.group, length)
            return comm.gather(act.tensor, axis, self.group, length)

    def switch(self, act: SeqTensor, dim: str) -> SeqTensor:
        """Re-shard ``act`` on ``dim`` with one all-to-all (no-op if already sharded there)."""
        src = act.spec.sharded
        if src == dim:
            return act
        if src is None:
            raise ValueError("switch: the activation is replicated; use shard() to split it")
        if act.spec.layout != "contiguous":
            raise ValueError(
                f"switch: the activation is sharded in the {act.spec.layout!r} layout, which "
                f"only fixed-dim plans use; it cannot switch from {src!r} to {dim!r}"
            )
        out = comm.switch(
            act.tensor, act.spec.axis(src), act.spec.axis(dim), self.group, act.spec.length(src)
        )
        return SeqTensor(out, act.spec.with_sharded(dim), act.plan)

    # -- stages and attention ---------------------------------------------------------------
    def to_stage(self, act: SeqTensor, stage: str) -> SeqTensor:
        """Make ``act`` ready for ``stage``: switch to the planned sharded dim (if it differs)
        and put the planned method in force for the stage's attention."""
        if act.plan is None:
            raise ValueError(
                "to_stage: the activation has no plan; create it with sp.enter(..., stages=...)"
            )
        step = act.plan.step_for(stage)
        with comm_region(stage):
            act = self.switch(act, step.sharded)
        return replace(act, spec=act.spec.with_method(step.method))

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: SeqSpec,
        over: str | tuple[str, ...],
        mask: torch.Tensor | None = None,
        causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Self-attention along sequence dim(s) ``over`` (several dims: attended jointly).

        ``q, k, v``: ``[B, *seq_local, H, D]`` laid out as ``spec`` (heads and head dim last;
        ``k``/``v`` may have fewer heads: GQA). The other sequence dims act as batch dims.
        Local when the sharded dim is not attended over; otherwise the plan's method
        (Ulysses, Ring, LSS, USP) communicates. Returns ``[B, *seq_local, H, D]``.
        """
        from .strategies.dispatch import sharded_attention

        return sharded_attention(self, q, k, v, spec, over, mask, causal, scale)

    # -- lockstep helpers -------------------------------------------------------------------
    def shard_like(
        self, t: torch.Tensor, act: SeqTensor | SeqSpec, axes: dict[str, int] | None = None
    ) -> torch.Tensor:
        """This rank's slice of a replicated ``t`` matching ``act``'s sharding.

        For position embeddings, per-frame conditioning and masks: ``axes`` maps sequence dim
        names to ``t``'s axes (default: the same axes as ``act``). An axis of size 1 broadcasts
        and is left alone; a dim ``t`` does not have is ignored.
        """
        spec = act.spec if isinstance(act, SeqTensor) else act
        dim = spec.sharded
        if dim is None or self.size == 1:
            return t
        axes = {n: spec.axis(n) for n in spec.names} if axes is None else axes
        if dim not in axes:
            return t
        axis = axes[dim]
        size, full = t.shape[axis], spec.length(dim)
        if size == 1:
            return t
        if size != full:
            raise ValueError(
                f"shard_like: axis {axis} of a tensor of shape {tuple(t.shape)} has size {size}, but sequence "
                f"dim {dim!r} has length {full} (or 1 to broadcast)"
            )
        return self._split(t, axis, spec.layout)

    # -- randomness on sharded activations --------------------------------------------------
    def dropout(
        self,
        act: SeqTensor,
        p: float,
        key: int,
        shared_along: tuple[str, ...] = (),
        training: bool = True,
        batch_offset: int = 0,
    ) -> SeqTensor:
        """Keyed inverted dropout of ``act``: bit for bit the one-process mask, on any sharding.

        ``key`` comes from the caller, e.g. ``mix_key(seed, step, layer, "dropout")``, and must
        be equal on the ranks of the group; ``shared_along`` names sequence dims along which one
        mask value is shared (AlphaFold's row-/column-wise dropout); ``batch_offset`` is the
        global index of the local batch's first sample. The global RNG is not touched. See
        :mod:`dspzoo.core.sharded_rng`.
        """
        from .sharded_rng import seq_dropout

        return seq_dropout(self, act, p, key, shared_along, training, batch_offset)

    # -- tensor parallelism (megatron_sp) ---------------------------------------------------
    def tp_enter(self, x: torch.Tensor, spec: SeqSpec) -> tuple[torch.Tensor, SeqSpec]:
        """Before a block's column-parallel input linear(s): the full sequence, if needed.

        Under ``megatron_sp`` (``spec.method``) ``x``, sharded on ``spec.sharded``, is
        all-gathered (backward: reduce-scatter) and returned with a replicated spec, so the
        block's attention over any dim runs locally on its local heads. Otherwise ``(x, spec)``.
        """
        if spec.method != "megatron_sp" or self.size == 1:
            return x, spec
        from .methods.megatron import gather_sequence

        return gather_sequence(x, spec, self.group)

    def tp_exit(self, linear: torch.nn.Module, y: torch.Tensor, spec: SeqSpec) -> torch.Tensor:
        """``linear(y)`` laid out as ``spec``: a block's output linear after :meth:`tp_enter`.

        Under ``megatron_sp`` ``linear`` is row-parallel: the partial sums of the local
        heads / hidden units are reduce-scattered onto ``spec``'s sharded dim (backward:
        all-gather) and the bias is added once, after the reduction. Otherwise ``linear(y)``.
        """
        if spec.method != "megatron_sp" or self.size == 1:
            return linear(y)
        from .methods.megatron import row_parallel_output

        return row_parallel_output(linear, y, spec, self.group)

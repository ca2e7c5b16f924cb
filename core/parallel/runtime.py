"""The runtime a model talks to: sharded activations and the SP context.

A model is written once, as if on one device, in terms of stages. Its top level enters the
sharded region and opens it for its blocks, which then see plain local tensors::

    act = sp.enter(x, names=("t", "s"), stages=STAGES)   # split on the planned dim
    with sp.region(act) as region:                       # blocks get plain tensors
        x = act.tensor
        for block in blocks:
            x = stage("spatial", x)                      # (in the block) switch as planned
            x = x + attn(norm(x))                        # SeqSelfAttention reads the layout
            ...
        act = region.seq(x)
    out = sp.exit(act)                                   # gather (or keep sharded for the loss)

(:mod:`dspzoo.core.parallel.context`: ``stage``, ``local`` for tensors that travel with the activation,
``layout``.) The explicit form stays available and is what the region runs on::

    act = sp.to_stage(act, "spatial")                    # switch if the plan says so
    h = sp.attention(q, k, v, act.spec, over="s")        # attention over a whole dim

:class:`SeqTensor` carries the local tensor together with its :class:`~dspzoo.core.parallel.layout.SeqSpec`
(names, true lengths, sharded dim, the method in force) and the plan, so the sharding state is
explicit and travels with the data. The strategy is a planning policy chosen at run time
(``dsp``, ``ulysses``, ``ring``, ``lss``, ``usp``): the plan names, per stage, the sharded dim
and the method, and this runtime executes any plan the same way — ``to_stage`` switches and
sets the method, ``attention`` runs locally or through the method.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from . import comm
from .comm.agreement import Signature, agree_in_full, trusted_calls
from .context import Region, check_local_shape, open_region
from .layout import SeqSpec, shard_sizes
from .mesh import SPMesh
from .methods.megatron import gather_sequence, row_parallel_output
from .methods.registry import get_method
from .methods.ring import zigzag_gather, zigzag_positions, zigzag_split
from .methods.scan import ScanOp, fold_scan_dims, unfold_scan_dims
from .plan import Plan, Stage
from .sharded_rng import seq_dropout
from .strategies import get_strategy
from .strategies.base import Strategy
from .strategies.dispatch import sharded_attention
from .trace import comm_region
from .validate import local_outcome

PLAN_CACHE_SIZE = 64  # plans kept per runtime (least recently used dropped)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _canonical(obj: Any) -> Any:
    """``obj`` with sets sorted and dataclasses spelt out: a ``repr`` equal in every process
    (a set's iteration order depends on the process's string hashing)."""
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted((_canonical(v) for v in obj), key=repr))
    if isinstance(obj, (tuple, list)):
        return tuple(_canonical(v) for v in obj)
    if isinstance(obj, dict):
        return ("dict", sorted(((repr(k), _canonical(v)) for k, v in obj.items()), key=repr))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        return (
            type(obj).__name__,
            tuple((f.name, _canonical(getattr(obj, f.name))) for f in fields),
        )
    return obj


def stable_crc(obj: Any) -> int:
    """A CRC of ``obj`` (plans, stages, names) that is the same in every process."""
    return zlib.crc32(repr(_canonical(obj)).encode())


def agreed_call(method: _Method) -> _Method:
    """Run a runtime method inside :func:`~dspzoo.core.parallel.comm.agreement.trusted_calls`
    once its :class:`SeqParallel` made its entry agreement (:meth:`SeqParallel.agree_entry`):
    its collectives are deterministic functions of what was agreed and exchange nothing more.
    For methods of :class:`SeqParallel` and of objects holding one as ``self.sp``."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        sp = self if isinstance(self, SeqParallel) else self.sp
        sp._fresh = False
        if not sp._entered or sp.size == 1:
            return method(self, *args, **kwargs)
        with contextlib.ExitStack() as trusted:
            for group in sp.agreed_groups():
                trusted.enter_context(trusted_calls(group))
            return method(self, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


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
        strategy: a name from :data:`dspzoo.core.parallel.strategies.STRATEGIES` (``"dsp"``,
            ``"ulysses"``, ``"ring"``, ``"lss"``, ``"usp"``) or a :class:`Strategy` instance.
        dim: for an embedded strategy, the sequence dim to shard (default: the longest).
        switch_chunk: in no-grad mode, switch in pieces of at most this many channels into a
            preallocated output (bounds the send/receive buffers; the same bytes).

    The runtime checks the contract between plan and model as it runs: a stage planned with
    a method whose op kind is called through the runtime (``sp.attention`` for attention,
    ``sp.tp_enter`` under Megatron-SP) must make that call while the stage is in force;
    otherwise the next ``to_stage`` / ``exit`` raises (the same error on every rank, which
    all run the same plan), instead of returning silently wrong outputs.
    """

    def __init__(
        self,
        mesh: SPMesh | None = None,
        strategy: str | Strategy = "dsp",
        dim: str | None = None,
        switch_chunk: int | None = None,
    ) -> None:
        self.mesh = mesh
        self.group: Any = None if mesh is None else mesh.sp_group
        self.size = comm.group_size(self.group)
        self.rank = comm.group_rank(self.group)
        self.strategy = get_strategy(strategy, dim) if isinstance(strategy, str) else strategy
        self.switch_chunk = switch_chunk
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._open: tuple[str, str, str, str] | None = None  # (stage, method, entry, dim)
        self._entered = False  # an entry agreement was made (agree_entry): calls are trusted
        self._fresh = False  # ... and no runtime call has run since (enter makes no second one)
        #: the stage of the last ``to_stage`` (its name and declared dims), for error messages
        self.last_stage: tuple[str, tuple[str, ...]] | None = None

    def agreed_groups(self) -> tuple[Any, ...]:
        """The groups the entry agreement covers: the SP group and, under USP, its Ulysses
        and ring sub-groups (their ranks are the SP group's; their calls follow its plan)."""
        mesh = self.mesh
        subs = () if mesh is None else (mesh.ulysses_group, mesh.ring_group)
        return (self.group, *(g for g in subs if g is not None))

    def __repr__(self) -> str:
        return f"SeqParallel(size={self.size}, rank={self.rank}, strategy={self.strategy.name!r})"

    # -- planning ---------------------------------------------------------------------------
    def plan(
        self, names: tuple[str, ...], lengths: tuple[int, ...], stages: tuple[Stage, ...]
    ) -> Plan:
        """The (cached) plan for these dims, lengths and stages at this group's size."""
        key = (tuple(names), tuple(lengths), tuple(stages))
        if key in self._plans:
            self._plans.move_to_end(key)
        else:
            self._plans[key] = self.strategy.plan(
                tuple(names), tuple(lengths), tuple(stages), self.size
            )
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return self._plans[key]

    # -- entering and leaving the sharded region --------------------------------------------
    def enter(
        self,
        x: torch.Tensor,
        names: tuple[str, ...],
        stages: tuple[Stage, ...],
        first_axis: int = 1,
        check: Callable[[], None] | None = None,
        what: str = "inputs",
    ) -> SeqTensor:
        """Replicated ``x`` → :class:`SeqTensor` sharded on the plan's entry dim.

        Makes the forward's one agreement (:meth:`agree_entry`, with ``check`` and ``what``)
        unless the model made it already in this forward, before anything else.
        """
        spec = SeqSpec.of(x, tuple(names), first_axis)
        plan = self.plan(spec.names, spec.lengths, tuple(stages))
        self._open = None  # a new pass: nothing left in force from an interrupted one
        self.last_stage = None
        if check is not None or not self._fresh:
            key = (tuple(names), first_axis, plan, self.switch_chunk)
            self.agree_entry({"x": x}, key, check=check, what=what)
        return self.shard(x, spec, plan.entry, plan)

    def agree_entry(
        self,
        inputs: dict[str, torch.Tensor],
        plan_key: Any = (),
        check: Callable[[], None] | None = None,
        what: str = "inputs",
    ) -> None:
        """The one agreement of a forward, on the host; raises the same error on every rank.

        Every rank runs ``check()`` (raising ``ValueError``/``TypeError`` for bad input) and
        then, in one tiny exchange over the SP group's control side group, the ranks agree
        that every check passed (else every rank raises
        :class:`~dspzoo.core.parallel.comm.InputValidationError` naming the ranks and their
        messages, ``what`` saying what was checked), that they hold replicated ``inputs`` of
        the same shapes, dtypes and devices, and that they plan alike: the same strategy, SP
        size, gradient mode, debug mode and ``plan_key`` (what the plan depends on besides
        the inputs' shapes: dim names, stages, a plan; compared as a CRC). A mismatch raises
        the same :class:`~dspzoo.core.parallel.comm.CollectiveInputError` on every rank.

        Call it first in the forward, before any code that could fail on one rank only
        (anything that reads the inputs' shapes); :meth:`enter` then makes no second one.
        Afterwards the runtime's own calls (its methods, the regions' ``stage``, ``local``
        and ``gather_for_local_use``) exchange nothing more until the next entry
        (:func:`agreed_call`); direct calls of :mod:`~dspzoo.core.parallel.comm` by the
        model still agree.
        """
        self._entered = self._fresh = False
        error = local_outcome(check)
        if self.size == 1:
            if error is not None:
                raise error
            return
        sig = Signature("entry")
        sig.what, sig.error = what, error
        strategy = tuple(getattr(self.strategy, a, None) for a in ("name", "dim", "layout"))
        key = (strategy, self.size, torch.is_grad_enabled(), comm.SETTINGS.debug, plan_key)
        sig.arg("plan (a CRC of strategy, SP size, grad and debug modes, plan)", stable_crc(key))
        device = "cpu"
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor):  # the check names what is wrong with it
                continue
            if len(inputs) <= 3:
                sig.tensor(name, t)
            else:  # many inputs: one word each (the error names the input, not its shape)
                desc = (str(t.dtype), t.device.type, tuple(t.shape))
                sig.arg(f"{name} (dtype, device, shape: a CRC)", stable_crc(desc))
            device = t.device
        agree_in_full(sig, self.group, device)
        self._entered = self._fresh = True

    @agreed_call
    def shard(
        self, x: torch.Tensor, spec: SeqSpec, dim: str, plan: Plan | None = None
    ) -> SeqTensor:
        """Replicated ``x`` described by ``spec`` → sharded on ``dim`` (in the plan's layout)."""
        layout = "contiguous" if plan is None else plan.layout
        spec = replace(spec.with_sharded(dim), layout=layout)
        return SeqTensor(self._split(x, spec.axis(dim), layout), spec, plan)

    def _split(self, t: torch.Tensor, axis: int, layout: str) -> torch.Tensor:
        if layout == "zigzag" and self.size > 1:
            return zigzag_split(t, axis, self.group)
        return comm.split(t, axis, self.group)

    @agreed_call
    def exit(self, act: SeqTensor) -> torch.Tensor:
        """Sharded :class:`SeqTensor` → replicated tensor (identical use on every rank)."""
        self._close_stage()
        spec = act.spec
        if spec.sharded is None:
            return act.tensor
        axis, length = spec.axis(spec.sharded), spec.length(spec.sharded)
        with comm_region("exit"):
            if spec.layout == "zigzag" and self.size > 1:
                return zigzag_gather(act.tensor, axis, self.group, length)
            return comm.gather(act.tensor, axis, self.group, length)

    @agreed_call
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
        out = self._switch_tensor(
            act.tensor, act.spec.axis(src), act.spec.axis(dim), act.spec.length(src)
        )
        return SeqTensor(out, act.spec.with_sharded(dim), act.plan)

    @agreed_call
    def _switch_tensor(
        self, x: torch.Tensor, src: int, dst: int, length: int, chunk: int | None = None
    ) -> torch.Tensor:
        """One switch of ``x`` from axis ``src`` to ``dst``; in pieces of ``chunk`` (default
        ``switch_chunk``) channels into a preallocated output when gradients are off."""
        chunk = self.switch_chunk if chunk is None else chunk
        if self.size == 1:
            return x
        if torch.is_grad_enabled() or chunk is None or x.shape[-1] <= chunk:
            return comm.switch(x, src, dst, self.group, length)
        shape = list(x.shape)
        shape[src], shape[dst] = length, shard_sizes(x.shape[dst], self.size)[self.rank]
        out = x.new_empty(shape)
        for c0 in range(0, x.shape[-1], chunk):
            part = x[..., c0 : c0 + chunk]
            out[..., c0 : c0 + chunk] = comm.switch(part, src, dst, self.group, length)
        return out

    @agreed_call
    def switch_async(self, act: SeqTensor, dim: str) -> tuple[comm.SwitchHandle, SeqSpec]:
        """Launch the switch of ``act`` to ``dim``; ``handle.wait()`` gives the local tensor of
        the returned spec. Overlaps whatever runs before the wait."""
        src = act.spec.sharded
        if src is None or src == dim:
            raise ValueError(f"switch_async: nothing to switch ({src!r} -> {dim!r})")
        handle = comm.switch_async(
            act.tensor, act.axis(src), act.axis(dim), self.group, act.spec.length(src)
        )
        return handle, act.spec.with_sharded(dim)

    @contextmanager
    def region(self, act: SeqTensor) -> Iterator[OneActivation]:
        """Open the sharded region of ``act`` (from :meth:`enter`) for plain-tensor blocks.

        Inside the ``with`` block, :func:`dspzoo.core.parallel.context.stage` moves the local tensor
        from stage to stage, layers read the layout from the region, and
        :func:`~dspzoo.core.parallel.context.local` slices tensors that travel with the activation;
        ``region.seq(x)`` gives the result back as a :class:`SeqTensor` (e.g. for :meth:`exit`).
        """
        with open_region(OneActivation(self, act)) as region:
            yield region

    # -- stages and attention ---------------------------------------------------------------
    def stage_words(self) -> str:
        """`` with stage 'name' in force (declared as mixing t, s)`` for the last
        ``to_stage``, or ``""``."""
        if self.last_stage is None:
            return ""
        name, mixes = self.last_stage
        return f" with stage {name!r} in force (declared as mixing {', '.join(mixes) or 'nothing'})"

    @agreed_call
    def to_stage(self, act: SeqTensor, stage: str) -> SeqTensor:
        """Make ``act`` ready for ``stage``: switch to the planned sharded dim (if it differs)
        and put the planned method in force for the stage's attention."""
        if act.plan is None:
            raise ValueError(
                "to_stage: the activation has no plan; create it with sp.enter(..., stages=...)"
            )
        self._close_stage()
        step = act.plan.step_for(stage)
        self.last_stage = (stage, tuple(step.mixes))
        with comm_region(stage):
            if act.spec.sharded is None:  # after a gather stage: keep this rank's rows again
                act = self.shard(act.tensor, act.spec, step.sharded, act.plan)
            act = self.switch(act, step.sharded)
            if step.method == "gather" and self.size > 1:
                whole = self._gather_whole(act)
                return SeqTensor(whole, act.spec.with_sharded(None).with_method("gather"), act.plan)
        entry = get_method(step.method).entry
        if entry and self.size > 1 and step.sharded in step.mixes:
            self._open = (stage, step.method, entry, step.sharded)
        return replace(act, spec=act.spec.with_method(step.method))

    @agreed_call
    def _gather_whole(self, act: SeqTensor) -> torch.Tensor:
        """The whole activation on every rank for a stage each rank then uses for its own rows
        (all-gather for local use; backward: reduce-scatter), in either layout."""
        spec, dim = act.spec, act.spec.sharded
        axis, length = spec.axis(dim), spec.length(dim)
        if spec.layout == "contiguous":
            return comm.gather_for_local_use(act.tensor, axis, self.group, length)
        sizes = spec.shard_lengths(dim, self.size)
        longest, x = max(sizes), act.tensor
        if x.shape[axis] < longest:  # pad to equal chunks, gather, put rows in true order
            pad = list(x.shape)
            pad[axis] = longest - x.shape[axis]
            x = torch.cat([x, x.new_zeros(pad)], dim=axis)
        full = comm.gather_for_local_use(x, axis, self.group, self.size * longest)
        order = torch.empty(length, dtype=torch.long)
        for r in range(self.size):
            order[zigzag_positions(length, self.size, r)] = torch.arange(sizes[r]) + r * longest
        return full.index_select(axis, order.to(full.device))

    def _close_stage(self) -> None:
        """Raise if the stage in force was planned with a method it never called."""
        if self._open is None:
            return
        stage, method, entry, dim = self._open
        self._open = None
        raise RuntimeError(
            f"stage {stage!r} was planned to run with {method!r} over the sharded dim {dim!r}, "
            f"which works only through {entry}(...), but the stage never called it: its output "
            f"would be silently wrong. If the stage computes something other than attention "
            f"(a convolution, pooling, an FFT, a custom mixer), declare it: "
            f"Stage({stage!r}, mixes=..., op='generic'), and every strategy will give it its "
            f"dims whole; if it does attend, call sp.attention for it."
        )

    def _used(self, entry: str) -> None:
        if self._open is not None and self._open[2] == entry:
            self._open = None

    @agreed_call
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
        over_dims = (over,) if isinstance(over, str) else tuple(over)
        if spec.sharded in over_dims and spec.method != "local":
            self._used("sp.attention")
        return sharded_attention(self, q, k, v, spec, over, mask, causal, scale)

    @agreed_call
    def scan(
        self, op: ScanOp, x: torch.Tensor, spec: SeqSpec, over: str | tuple[str, ...]
    ) -> torch.Tensor:
        """A selective scan (Mamba mixer ``op``) along sequence dim(s) ``over``, in that order.

        ``x``: ``[B, *seq_local, C]`` laid out as ``spec``. The ``over`` dims are flattened into
        one scanned sequence, the first outermost (a raster order), the other dims join the
        batch; ``op`` maps ``[B', L, C]`` to ``[B', L, C']``. Local when the sharded dim is not
        scanned (DSP's axial case); otherwise the plan's scan method (``state_passing``,
        ``head_a2a``) runs ``op`` on this rank's segment, which needs the sharded dim to be the
        outermost of ``over``. Returns ``[B, *seq_local, C']``.
        """
        over_dims = (over,) if isinstance(over, str) else tuple(over)
        if not over_dims or len(set(over_dims)) != len(over_dims):
            raise ValueError(f"sp.scan: name the dims to scan, each once (got over={over!r})")
        for name in over_dims:
            spec.index(name)  # clear error for unknown dims
        sharded = spec.sharded
        folded, moved = fold_scan_dims(x, spec, over_dims)
        if self.size == 1 or sharded is None or sharded not in over_dims:
            return unfold_scan_dims(op(folded), moved, spec, over_dims)
        if spec.method == "local":
            raise RuntimeError(
                f"{self.strategy.name}: a scan over {over_dims}{self.stage_words()} while "
                f"{sharded!r} is sharded and the stage's plan says 'local'; call sp.to_stage() "
                f"for this stage first, or declare that the stage mixes {over_dims} with "
                f"op='scan'"
            )
        if over_dims[0] != sharded:
            raise ValueError(
                f"a scan over {over_dims} (in that order) with {sharded!r} sharded: each rank "
                f"would hold pieces of the sequence, not one segment. Scan with the sharded dim "
                f"outermost, or plan the stage so that {sharded!r} is whole (a DSP switch)"
            )
        self._used("sp.scan")
        rest = math.prod(spec.length(d) for d in over_dims[1:])
        seq_lengths = [s * rest for s in spec.shard_lengths(sharded, self.size)]
        out = get_method(spec.method).scan(self, op, folded, seq_lengths)
        return unfold_scan_dims(out, moved, spec, over_dims)

    # -- lockstep helpers -------------------------------------------------------------------
    @agreed_call
    def shard_like(
        self, t: torch.Tensor, act: SeqTensor | SeqSpec, axes: dict[str, int] | None = None
    ) -> torch.Tensor:
        """This rank's slice of a replicated ``t`` matching ``act``'s sharding.

        For position embeddings, per-frame conditioning and masks: ``axes`` maps sequence dim
        names to ``t``'s axes (default: the same axes as ``act``). An axis of size 1 broadcasts
        and is left alone (unless the dim's length is 1: then it is the dim, and a rank whose
        shard is empty gets no row of it); a dim ``t`` does not have is ignored.
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
        if size == 1 and full != 1:  # broadcasts (a dim of length 1 is sliced like any other)
            return t
        if size != full:
            raise ValueError(
                f"shard_like: axis {axis} of a tensor of shape {tuple(t.shape)} has size {size}, but sequence "
                f"dim {dim!r} has length {full} (or 1 to broadcast)"
            )
        return self._split(t, axis, spec.layout)

    # -- randomness on sharded activations --------------------------------------------------
    @agreed_call
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
        :mod:`dspzoo.core.parallel.sharded_rng`.
        """
        return seq_dropout(self, act, p, key, shared_along, training, batch_offset)

    # -- tensor parallelism (megatron_sp) ---------------------------------------------------
    @agreed_call
    def tp_enter(self, x: torch.Tensor, spec: SeqSpec) -> tuple[torch.Tensor, SeqSpec]:
        """Before a block's column-parallel input linear(s): the full sequence, if needed.

        Under ``megatron_sp`` (``spec.method``) ``x``, sharded on ``spec.sharded``, is
        all-gathered (backward: reduce-scatter) and returned with a replicated spec, so the
        block's attention over any dim runs locally on its local heads. Otherwise ``(x, spec)``.
        """
        if not get_method(spec.method).tensor_parallel or self.size == 1:
            return x, spec
        self._used("sp.tp_enter")
        return gather_sequence(x, spec, self.group)

    @agreed_call
    def tp_exit(self, linear: torch.nn.Module, y: torch.Tensor, spec: SeqSpec) -> torch.Tensor:
        """``linear(y)`` laid out as ``spec``: a block's output linear after :meth:`tp_enter`.

        Under ``megatron_sp`` ``linear`` is row-parallel: the partial sums of the local
        heads / hidden units are reduce-scattered onto ``spec``'s sharded dim (backward:
        all-gather) and the bias is added once, after the reduction. Otherwise ``linear(y)``.
        """
        if not get_method(spec.method).tensor_parallel or self.size == 1:
            return linear(y)
        return row_parallel_output(linear, y, spec, self.group)


class OneActivation(Region):
    """The region of one activation (``sp.region(act)``): its current layout and plan.

    :meth:`stage` is :meth:`SeqParallel.to_stage` on plain tensors; the contract checks (a
    stage planned with a method must call its entry) are the runtime's.
    """

    def __init__(self, sp: SeqParallel, act: SeqTensor) -> None:
        if act.plan is None:
            raise ValueError(
                "sp.region: the activation has no plan; create it with sp.enter(..., stages=...)"
            )
        self.sp, self.act = sp, act

    def snapshot(self) -> OneActivation:
        # a stage rebinds self.act and self.stage_name (never mutates them): a shallow copy
        return copy.copy(self)

    def seq(self, x: torch.Tensor) -> SeqTensor:
        """The local tensor ``x`` (this rank's shard in the current layout) as a SeqTensor."""
        check_local_shape(x, self.act.spec, self.sp.rank, self.sp.size, "region.seq")
        return SeqTensor(x, self.act.spec, self.act.plan)

    def wrap(self, t: torch.Tensor, act: str | None = None) -> SeqTensor:
        """``t`` (same sequence axes as the activation, any channels) in the current layout."""
        self._one(act, "wrap")
        return SeqTensor(t, self.act.spec, self.act.plan)

    def _one(self, act: str | None, what: str) -> None:
        if act is not None:
            raise ValueError(
                f"{what}: this region carries one activation; call it without a name (got {act!r})"
            )

    def stage(
        self, name: str, x: torch.Tensor | None, acts: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if x is None or acts:
            raise TypeError(
                f"stage({name!r}): this region carries one activation: x = stage({name!r}, x)"
            )
        act = self.sp.to_stage(self.seq(x), name)
        self.act, self.stage_name = act, name
        return act.tensor

    def spec(self, act: str | None = None) -> SeqSpec:
        self._one(act, "layout")
        return self.act.spec

    def local(self, t: torch.Tensor, act: str | None, axes: dict[str, int] | None) -> torch.Tensor:
        self._one(act, "local")
        spec = self.act.spec
        if axes is None and t.dim() < spec.first_axis + len(spec.names):
            return t  # per sample ([B, C]): nothing laid along the sequence dims
        return self.sp.shard_like(t, spec, axes)

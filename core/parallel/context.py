"""Plain-tensor blocks: the sharded region a model's top level opens, read by blocks and layers.

A model's top level enters the sharded region as it always has, and opens it for its blocks::

    act = sp.enter(x, names=("t", "s"), stages=STAGES)     # split on the planned dim
    with sp.region(act) as region:                         # blocks now see plain tensors
        x = act.tensor
        for block in self.blocks:
            x = block(x, mod)                              # see below
        act = region.seq(x)                                # back to a SeqTensor
    out = sp.exit(act)

While the region is open, a context variable holds the runtime and the current layout (spec
and plan) of every activation in flight, so a block reads like its single-device self plus one
line per stage::

    def forward(self, x, mod):
        x = stage("spatial", x)                # switch as planned; the layout is updated
        x = x + self.attn(self.norm1(x))       # SeqSelfAttention reads the layout itself
        x = stage("mlp", x)
        return x + self.mlp(self.norm2(x))

* :func:`stage` — plain local tensor(s) in and out: switches per plan (``sp.to_stage`` for one
  activation, :class:`~dspzoo.core.parallel.multiplan.MultiParallel` for several, with its overlapped
  asynchronous switches), puts the stage's method in force and records the new layout.
* :func:`local` — this rank's slice, for the current layout, of a tensor that travels with an
  activation (per-frame modulation, position tables, masks): laid out like the activation, each
  sequence axis whole or of size 1 (broadcast). ``modulate``/``gated`` call it themselves.
* :func:`layout`, :func:`sharded`, :func:`runtime` — what layers that communicate ask for
  (``SeqSelfAttention``, ``Mlp``'s tensor-parallel hooks); :func:`gather_for_local_use` and
  :func:`dropout` for layers that need an operand whole or keyed dropout masks.

With several activations, :func:`stage` names them: ``m, z = stage("msa_row", m=m, z=z)``. A
switch the plan overlaps with later stages is launched from the tensor last passed for that
activation; passing a *different* tensor for it before the switch is consumed raises (the
block changed an activation the plan had already sent away).

Outside any region the helpers are the single-device identity (``local``, gathers: their
input; ``sharded``: ``None``), except :func:`stage` and :func:`layout`, which raise a clear
error naming what to call: a block written with ``stage`` runs inside the region its model
opens. The explicit API (``SeqTensor``, ``sp.to_stage``, ``sp.attention(q, k, v, spec, over)``)
keeps working unchanged beside it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch

from .layout import SeqSpec

_ACTIVE: ContextVar[Region | None] = ContextVar("dspzoo_region", default=None)

_HOW = (
    "open the region at the model's top level: act = sp.enter(x, names, stages); "
    "with sp.region(act): ... (several activations: with MultiParallel(sp, plan).region(m=..., "
    "z=...): ...)"
)


class Region(ABC):
    """The activations of one open sharded region: the runtime and each one's current layout.

    Subclasses: the one-activation region of :class:`~dspzoo.core.parallel.runtime.SeqParallel`
    (``sp.region(act)``) and the several-activation region of
    :class:`~dspzoo.core.parallel.multiplan.MultiParallel` (``mp.region(m=..., z=...)``).
    """

    sp: Any  # the SeqParallel runtime
    stage_name: str | None = None  # the stage in force (the last one ``stage`` entered)

    @abstractmethod
    def stage(
        self, name: str, x: torch.Tensor | None, acts: dict[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Move the given local tensors to stage ``name`` as planned; return them."""

    @abstractmethod
    def spec(self, act: str | None = None) -> SeqSpec:
        """The current layout of activation ``act`` (``None``: the only one)."""

    @abstractmethod
    def local(self, t: torch.Tensor, act: str | None, axes: dict[str, int] | None) -> torch.Tensor:
        """This rank's slice of ``t`` (laid out like ``act``) under the current layout."""

    def gather_for_local_use(self, t: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """``t`` (laid out like ``act``, any channels) whole along ``act``'s sharded dim, for a
        use that differs on every rank (backward: reduce-scatter)."""
        raise NotImplementedError(f"{type(self).__name__} has no gather for local use")

    @abstractmethod
    def wrap(self, t: torch.Tensor, act: str | None = None) -> Any:
        """``t`` as a :class:`~dspzoo.core.parallel.runtime.SeqTensor` in ``act``'s current layout."""

    def activation_with(self, dims: tuple[str, ...]) -> str | None:
        """The activation name whose dims include ``dims`` (``None``: the only one)."""
        return None

    def snapshot(self) -> Region:
        """A copy of this region in its present state (layouts, the stage in force), which the
        region's later stages do not change: what a checkpointed block's recomputation runs in
        (:func:`recompute_contexts`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be recomputed from a snapshot")

    def close(self) -> None:
        """Called when the region's ``with`` block ends normally (no stage is in force after)."""
        self.stage_name = None

    def release(self) -> None:
        """Called whenever the region's ``with`` block ends (normally or by an exception)."""
        self.stage_name = None


@contextmanager
def open_region(region: Region) -> Iterator[Region]:
    """Make ``region`` the active one for the ``with`` block (regions nest: the inner wins)."""
    token = _ACTIVE.set(region)
    try:
        yield region
        region.close()
    finally:
        region.release()
        _ACTIVE.reset(token)


def recompute_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for activation checkpointing (``torch.utils.checkpoint`` and
    ``torch.distributed._composable.checkpoint``) of a block written with :func:`stage`.

    Called as the block's forward starts: nothing around the forward, and around its
    recomputation in backward — after the model's region has closed — a snapshot of the region
    as it was when the block started (:meth:`Region.snapshot`), so the recomputed block switches
    and reads layouts exactly as its forward did. Outside a region: nothing around either.
    """
    region = _ACTIVE.get()
    if region is None:
        return nullcontext(), nullcontext()
    return nullcontext(), _reopened(region.snapshot())


@contextmanager
def _reopened(region: Region) -> Iterator[Region]:
    """``region`` active for the ``with`` block, left as the block leaves it (a snapshot)."""
    token = _ACTIVE.set(region)
    try:
        yield region
    finally:
        _ACTIVE.reset(token)


def active() -> Region | None:
    """The open region, or ``None`` outside one."""
    return _ACTIVE.get()


def current(what: str) -> Region:
    """The open region; outside one, a clear error naming ``what`` was called."""
    region = _ACTIVE.get()
    if region is None:
        raise RuntimeError(f"{what} needs an open sharded region, and none is open: {_HOW}")
    return region


def stage(
    name: str, x: torch.Tensor | None = None, /, **acts: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Enter stage ``name``: ``x = stage("spatial", x)`` or ``m, z = stage("msa_row", m=m, z=z)``.

    Plain local tensors in and out (in the order given): each is switched to the layout the plan
    gives it for this stage (no-op where it already is), the stage's method is put in force, and
    the region records the new layout for :func:`local`, attention and the next stage.
    """
    return current(f"stage({name!r})").stage(name, x, acts)


def current_stage() -> str | None:
    """The stage in force in the open region (``None`` outside one or before the first)."""
    region = _ACTIVE.get()
    return None if region is None else region.stage_name


def runtime() -> Any:
    """The open region's :class:`~dspzoo.core.parallel.runtime.SeqParallel` (``None`` outside one)."""
    region = _ACTIVE.get()
    return None if region is None else region.sp


def layout(act: str | None = None) -> SeqSpec:
    """The current layout (spec) of activation ``act`` (``None``: the region's only one)."""
    return current("layout()").spec(act)


def sharded(act: str | None = None) -> str | None:
    """The dim ``act`` is sharded on now; ``None`` when whole or outside a region."""
    region = _ACTIVE.get()
    return None if region is None else region.spec(act).sharded


def local(
    t: torch.Tensor, act: str | None = None, axes: dict[str, int] | None = None
) -> torch.Tensor:
    """This rank's slice of ``t``, a tensor that travels with activation ``act``.

    ``t`` is laid out like the activation (``[B, T', 1, C]`` per-frame modulation, a
    ``[1, 1, S, C]`` position table, a ``[B, S, R]`` mask): each sequence axis has the dim's
    full length or 1 (broadcast); ``axes`` maps dim names to ``t``'s axes when they sit
    elsewhere. A tensor with fewer axes than the activation's sequence dims reach (``[B, C]``,
    per sample) is returned as it is; so is everything outside a region.
    """
    region = _ACTIVE.get()
    return t if region is None else region.local(t, act, axes)


def gather_for_local_use(t: torch.Tensor, act: str | None = None) -> torch.Tensor:
    """``t`` (laid out like ``act``) all-gathered along ``act``'s sharded dim, for a use that
    differs on every rank (a pair bias, a triangle operand); backward: reduce-scatter. Outside
    a region, or when ``act`` is whole: ``t``."""
    region = _ACTIVE.get()
    return t if region is None else region.gather_for_local_use(t, act)


def dropout(
    t: torch.Tensor,
    p: float,
    key: int,
    shared_along: tuple[str, ...] | str = (),
    act: str | None = None,
    batch_offset: int = 0,
) -> torch.Tensor:
    """Keyed inverted dropout of ``t`` (laid out like ``act``; default: the activation whose
    dims include ``shared_along``), bit for bit the one-process mask on any sharding (see
    :meth:`~dspzoo.core.parallel.runtime.SeqParallel.dropout`)."""
    shared = (shared_along,) if isinstance(shared_along, str) else tuple(shared_along)
    region = current("dropout()")
    name = act if act is not None else region.activation_with(shared)
    out = region.sp.dropout(region.wrap(t, name), p, key, shared, True, batch_offset)
    return out.tensor


def check_local_shape(x: torch.Tensor, spec: SeqSpec, rank: int, size: int, what: str) -> None:
    """Raise a clear error if ``x``'s sequence axes are not ``spec``'s local shape on ``rank``."""
    want = spec.local_shape(rank, size)
    first = spec.first_axis
    got = tuple(x.shape[first : first + len(spec.names)])
    if x.dim() < first + len(spec.names) or got != want:
        raise ValueError(
            f"{what}: the tensor of shape {tuple(x.shape)} is not this rank's shard of the "
            f"activation: its dims {spec.names} at axis {first} should be {want} on rank "
            f"{rank}/{size} (global {spec.lengths}, sharded on {spec.sharded!r}). Pass the "
            f"tensor the previous stage returned (updated token-wise only)"
        )

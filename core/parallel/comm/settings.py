"""The settings the collectives read, and the CPU send workspaces they own (one per group).

:data:`SETTINGS` is the one explicit configuration object of :mod:`dspzoo.core.parallel.comm`; the
public setters (:func:`set_debug`, :func:`set_workspace_limit`, :func:`release_workspace`)
change it, and ``DSPZOO_DEBUG`` / ``DSPZOO_COMM_WORKSPACE_MIB`` give its starting values.

Workspaces: synchronous CPU sends reuse one buffer per ``(device, dtype)`` *per process
group* instead of a fresh buffer (on CPU a fresh multi-MiB buffer costs page faults comparable
to the copy itself). Each group's :class:`Workspace` grows to its largest send so far but never
beyond the limit; at most :attr:`CommSettings.max_workspaces` groups keep one (least recently
used dropped first), so building many meshes cannot grow memory without bound.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .rehearsal import Rehearsal


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "off", "no")


DIRECT_MIN_KIB = 512  # the direct switch's shortest message by default (docs/comm.md)
SHM_SLOT_KIB = 1024  # a shared-memory switch slot by default (docs/comm.md)


_UNITS = {"KiB": 1024, "MiB": 2**20}


def _env_bytes(name: str, default: float, unit: str = "KiB", can_be_off: bool = True) -> int | None:
    """``name``'s value in ``unit`` as bytes (``off``: ``None``, where ``can_be_off``);
    ``default`` ``unit`` when unset.

    A value that is not a number warns (naming the variable and the default it uses) instead
    of failing at import, which would break every command, ``--help`` included.
    """
    value = os.environ.get(name, "").strip()
    if can_be_off and value.lower() in ("off", "none", "never"):
        return None
    try:
        amount = float(value or default)
        if not (math.isfinite(amount) and amount >= 0):
            raise ValueError(value)
    except ValueError:
        off = " (or 'off')" if can_be_off else ""
        warnings.warn(
            f"{name}={value!r} is not a finite non-negative number of {unit}{off}; using the "
            f"default {default:g} {unit}. E.g. {name}={default:g}",
            stacklevel=2,
        )
        amount = default
    return int(amount * _UNITS[unit])


class Workspace:
    """One group's reusable CPU buffers, each kind bounded by ``limit`` bytes.

    * send buffers: one flat buffer per ``(device, dtype)``, grown to the largest send so far;
    * received results (:meth:`output`): the storages of recent results, handed out again once
      nobody else holds them (the caller dropped the result, autograd freed what it saved).
      A fresh multi-MiB CPU tensor costs a page fault per 4 KiB page when it is first written
      (glibc returns freed large blocks to the system), as much as the copy into it; a recycled
      one does not. At most :attr:`outputs_per_shape` storages per ``(device, dtype, numel)``.
    """

    outputs_per_shape = 2

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.outputs: OrderedDict[tuple[str, torch.dtype, int], list[torch.UntypedStorage]] = (
            OrderedDict()
        )

    def nbytes(self, free_only: bool = False) -> int:
        """Bytes kept (``free_only``: only those no tensor outside the workspace holds)."""
        sends = sum(b.numel() * b.element_size() for b in self.buffers.values())
        return sends + self.output_nbytes(free_only)

    def output_nbytes(self, free_only: bool = False) -> int:
        return sum(
            s.nbytes()
            for stores in self.outputs.values()
            for s in stores
            if not free_only or _only_ours(s)
        )

    def take(self, numel: int, like: torch.Tensor, limit: int) -> torch.Tensor | None:
        """A flat buffer of ``numel`` elements of ``like``'s dtype, or ``None`` above ``limit``."""
        if like.device.type != "cpu" or numel * like.element_size() > limit:
            return None
        key = (str(like.device), like.dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf[:numel]

    def output(self, shape: list[int], like: torch.Tensor, limit: int) -> torch.Tensor | None:
        """A contiguous tensor of ``shape`` on a storage nobody else holds, or ``None``.

        The tensor is not a view (it owns a reference to the storage like a fresh one), so the
        caller may return it as a collective's result. ``None`` (allocate fresh) off the CPU,
        above ``limit`` bytes, or when every kept storage of this size is still in use.
        """
        numel = math.prod(shape)
        nbytes = numel * like.element_size()
        if like.device.type != "cpu" or nbytes == 0 or nbytes > limit:
            return None
        key = (str(like.device), like.dtype, numel)
        stores = self.outputs.get(key)
        if stores is None:
            stores = self.outputs[key] = []
        self.outputs.move_to_end(key)
        free = next((s for s in stores if _only_ours(s)), None)
        if free is None:
            if len(stores) >= self.outputs_per_shape:
                return None
            free = torch.empty(numel, dtype=like.dtype, device=like.device).untyped_storage()
            stores.append(free)
            self._bound_outputs(limit)
        out = torch.empty(0, dtype=like.dtype, device=like.device)
        return out.set_(free, 0, shape, contiguous_strides(shape))

    def _bound_outputs(self, limit: int) -> None:
        """Forget the least recently used output storages beyond ``limit`` bytes in all."""
        while self.outputs and self.output_nbytes() > limit:
            self.outputs.popitem(last=False)

    def shrink(self, limit: int) -> None:
        """Drop the buffers larger than ``limit`` bytes."""
        for key, buf in list(self.buffers.items()):
            if buf.numel() * buf.element_size() > limit:
                del self.buffers[key]
        self._bound_outputs(limit)


def _only_ours(storage: torch.UntypedStorage) -> bool:
    """Whether the workspace's reference is the only one to ``storage`` (no tensor uses it)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return strides[::-1]


@dataclass
class CommSettings:
    """What the collectives of :mod:`dspzoo.core.parallel.comm` read; change it through the setters.

    Attributes:
        debug: also check in backward passes and compare the data of replicated inputs
            (``split``) across ranks, not only their shapes (``DSPZOO_DEBUG=1``).
        workspace_limit: bytes per ``(device, dtype)`` a group's send workspace may hold
            (``DSPZOO_COMM_WORKSPACE_MIB``, default 256 MiB).
        max_workspaces: groups that keep a workspace at once (least recently used dropped).
        recycle_results: results of CPU collectives reuse their group's free result storages
            (:meth:`Workspace.output`; ``DSPZOO_COMM_RECYCLE_RESULTS=1``). Off by default: it
            measured no gain (docs/comm.md), keeps up to ``workspace_limit`` of storages per
            group, and a caller holding only a result's ``untyped_storage()`` object (no
            tensor) is not seen as a holder.
        direct_min_bytes: a switch on gloo sends its blocks as point-to-point messages straight
            from the input into the result, with no pack or unpack copy, when every message is
            at least this long (:mod:`.direct`; ``DSPZOO_COMM_DIRECT_MIN_KIB``, ``off`` or
            ``None`` here never). The default is the shortest message at which the direct
            path measured no slower than the packed all-to-all on this project's 2-core CPU
            machine (512 KiB: 0.95× its time; 64 KiB: 2.2×; 4 MiB: 0.81–0.86×;
            ``docs/comm.md``). Must be equal on every rank (a checked switch compares it).
        direct_max_messages: the direct path's largest number of messages per peer (equal on
            every rank, like ``direct_min_bytes``).
        shm_slot_bytes: switches between the processes of one host on gloo go through shared
            memory (:mod:`.shm`) in chunks of at most this many bytes, two in flight per pair of
            ranks (``DSPZOO_COMM_SHM_SLOT_KIB``, default 1024; ``off`` or ``None`` here: over
            gloo). Read at a group's first switch for the size of its mailboxes (a later,
            larger value is capped at that size). Must be equal on every rank, like
            ``direct_min_bytes``.
        shm_doorbell: a rank waiting on the shared-memory channel for longer than 200 µs
            dozes on a doorbell (a FIFO) that the peer moving its next chunk rings, instead of
            sleeping a fixed 50 µs – 1 ms (``DSPZOO_COMM_SHM_DOORBELL=0``: the fixed sleeps).
            Only how a rank waits; it may differ between ranks.
    """

    debug: bool = field(default_factory=lambda: _env_flag("DSPZOO_DEBUG"))
    workspace_limit: int = field(
        default_factory=lambda: _env_bytes("DSPZOO_COMM_WORKSPACE_MIB", 256, "MiB", False) or 0
    )
    max_workspaces: int = 8
    recycle_results: bool = field(default_factory=lambda: _env_flag("DSPZOO_COMM_RECYCLE_RESULTS"))
    direct_min_bytes: int | None = field(
        default_factory=lambda: _env_bytes("DSPZOO_COMM_DIRECT_MIN_KIB", DIRECT_MIN_KIB)
    )
    direct_max_messages: int = 32
    shm_slot_bytes: int | None = field(
        default_factory=lambda: _env_bytes("DSPZOO_COMM_SHM_SLOT_KIB", SHM_SLOT_KIB)
    )
    shm_doorbell: bool = field(
        default_factory=lambda: _env_flag("DSPZOO_COMM_SHM_DOORBELL", default=True)
    )
    _workspaces: OrderedDict[int, tuple[Any, Workspace]] = field(
        default_factory=OrderedDict, repr=False
    )
    _rehearsals: dict[int, tuple[Any, Rehearsal]] = field(default_factory=dict, repr=False)

    def path_settings(self) -> tuple[int | None, int, int | None]:
        """The settings that choose how a collective travels (the shared-memory channel, the
        direct switch); they must be equal on every rank, and every agreement compares them
        (:func:`~.agreement.agree`)."""
        return self.direct_min_bytes, self.direct_max_messages, self.shm_slot_bytes

    def rehearsal(self, group: Any) -> Rehearsal:
        """The agreed calls of ``group`` (:mod:`.rehearsal`), created on first use.

        Never evicted: every rank of a group must hold the same history, and an eviction that
        depends on this rank's use of *other* groups would not happen on every rank alike.
        """
        key = id(group)
        entry = self._rehearsals.get(key)
        if entry is None or entry[0] is not group:
            entry = (group, Rehearsal())  # holding the group keeps its id from being reused
            self._rehearsals[key] = entry
        return entry[1]

    def workspace(self, group: Any) -> Workspace:
        """The send workspace of ``group`` (created on first use; LRU-bounded)."""
        key = id(group)
        entry = self._workspaces.get(key)
        if entry is None or entry[0] is not group:
            entry = (group, Workspace())  # holding the group keeps its id from being reused
            self._workspaces[key] = entry
            while len(self._workspaces) > self.max_workspaces:
                self._workspaces.popitem(last=False)
        self._workspaces.move_to_end(key)
        return entry[1]

    @contextlib.contextmanager
    def changed(self, **fields: Any) -> Iterator[CommSettings]:
        """These settings changed inside the block, restored after it (benchmarks and tests
        comparing paths: ``with SETTINGS.changed(direct_min_bytes=None): ...``). Changing a
        setting the switch's choice reads on one rank only is a mismatch every rank reports."""
        unknown = [k for k in fields if k.startswith("_") or not hasattr(self, k)]
        if unknown:
            raise AttributeError(f"CommSettings has no setting {unknown}")
        before = {k: getattr(self, k) for k in fields}
        for k, v in fields.items():
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in before.items():
                setattr(self, k, v)

    def release(self) -> int:
        """Drop every group's workspace; the bytes actually freed (result storages a tensor
        still holds stay alive with it and are not counted)."""
        freed = sum(ws.nbytes(free_only=True) for _, ws in self._workspaces.values())
        self._workspaces.clear()
        return freed


SETTINGS = CommSettings()


def set_debug(enabled: bool) -> None:
    """Debug mode: also check backward collectives and the data of replicated inputs.

    The checks that make a bad input on one rank raise on every rank run with debug mode off
    too; debug mode adds a checksum of ``split``'s input (it must be identical on every rank)
    and the same agreement before the backward collectives.
    """
    SETTINGS.debug = bool(enabled)


def debug_enabled() -> bool:
    """Whether debug mode is on (:func:`set_debug` or ``DSPZOO_DEBUG=1``)."""
    return SETTINGS.debug


def release_workspace() -> int:
    """Free the CPU send workspaces of every group; returns the bytes freed.

    Safe at any time outside a collective call: the next synchronous send allocates again.
    """
    return SETTINGS.release()


def set_workspace_limit(nbytes: int) -> int:
    """Cap each group's CPU send workspace at ``nbytes`` per ``(device, dtype)``; returns the old cap.

    Sends larger than the cap allocate a fresh buffer each time; workspace buffers already
    larger than the new cap are released.
    """
    if nbytes < 0:
        raise ValueError(f"workspace limit must be >= 0 bytes, got {nbytes}")
    previous, SETTINGS.workspace_limit = SETTINGS.workspace_limit, int(nbytes)
    for _, ws in SETTINGS._workspaces.values():
        ws.shrink(SETTINGS.workspace_limit)
    return previous

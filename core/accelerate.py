"""Accelerate integration: one call that builds the Accelerator, the mesh and the SP context.

Inside a script started by ``accelerate launch --multi_gpu --num_processes N`` (or
``torchrun``)::

    accelerator, mesh, sp = setup_accelerate(sp_size=2, seed=0)
    loader = sp_dataloader(dataset, mesh, batch_size=4)       # shard over dp, not the world
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP over dp × sp
    for batch in loader:
        loss = model(batch, sp)                                # per-rank loss, see core.loss
        accelerator.backward(loss)                             # DDP averages over dp × sp
        optimizer.step(); optimizer.zero_grad()

DDP (and FSDP2's ``fully_shard``) average gradients over the whole world; under the gradient
contract of :mod:`dspzoo.core.loss` that is exactly the data-parallel average of
single-process gradients, so no extra scaling is needed. ``accelerator.prepare`` builds DDP on
``mesh.grad_group`` (all ranks, a communicator of its own; see :mod:`dspzoo.core.parallel.mesh`), so its
bucket all-reduces never share a communicator with the SP group's collectives. On a machine without CUDA the
Accelerator is built with ``cpu=True`` and gloo (``--multi_gpu`` still starts N processes).
Nothing process-wide changes by default: glibc malloc's thresholds are raised only on request
(``keep_freed_memory=True`` or ``DSPZOO_KEEP_FREED_MEMORY=1``, see :func:`setup_accelerate`).
Accelerate's checkpoint note on a weight the model ties itself is recognised and not printed
(:mod:`dspzoo.core.quiet`).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from . import perf
from .errors import UsageError
from .parallel.mesh import SPMesh, build_mesh, seed_everything
from .parallel.runtime import SeqParallel
from .quiet import FirstRankOnly, recognise_tied_weights

logger = logging.getLogger(__name__)
logger.addFilter(FirstRankOnly())  # its lines are the same on every rank: say them once

KEEP_FREED_MEMORY_ENV = "DSPZOO_KEEP_FREED_MEMORY"
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")
_MESH_INPUTS = ("sp_size", "ulysses_size", "the collective timeout")


def _env_asks_keep_freed_memory() -> bool:
    """``DSPZOO_KEEP_FREED_MEMORY``: 1/true/yes/on → on; unset, empty or 0/false/no/off → off."""
    value = os.environ.get(KEEP_FREED_MEMORY_ENV, "").strip().lower()
    if value == "" or value in _FALSE:
        return False
    if value in _TRUE:
        return True
    raise UsageError(
        f"{KEEP_FREED_MEMORY_ENV}={os.environ[KEEP_FREED_MEMORY_ENV]!r}: expected one of "
        f"{list(_TRUE + _FALSE)}"
    )


def setup_accelerate(
    sp_size: int,
    *,
    seed: int = 0,
    strategy: str = "dsp",
    sp_dim: str | None = None,
    ulysses_size: int | None = None,
    mixed_precision: str = "no",
    cpu: bool | None = None,
    keep_freed_memory: bool | None = None,
    **accelerator_kwargs: Any,
) -> tuple[Accelerator, SPMesh, SeqParallel]:
    """Build ``(accelerator, mesh, sp)``, and seed RNGs per DP group.

    Args:
        sp_size: ranks per SP group; must divide the number of launched processes.
        seed: base seed; RNG is identical inside an SP group, distinct across DP groups.
        strategy: sequence-parallel strategy name (``dspzoo.core.parallel.strategies.STRATEGIES``).
        sp_dim: the dim an embedded strategy shards (default: the longest).
        ulysses_size: for ``usp``, the Ulysses degree inside the SP group (default:
            :func:`default_ulysses_size`).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (GPU), passed to Accelerate.
        cpu: force CPU; default: CPU when CUDA is unavailable.
        keep_freed_memory: on CPU, call :func:`dspzoo.core.perf.keep_freed_memory` (``True``),
            or not (``False``); ``None`` (the default) follows ``DSPZOO_KEEP_FREED_MEMORY``.

    **Process-wide side effect (CPU only, opt-in).** Asked for with ``keep_freed_memory=True``
    or the environment variable ``DSPZOO_KEEP_FREED_MEMORY=1`` (``1/true/yes/on``; the
    argument wins over the variable), on CPU this raises glibc malloc's mmap and trim
    thresholds (``M_MMAP_THRESHOLD`` 1 GiB, ``M_TRIM_THRESHOLD`` 2 GiB) for the whole process,
    so freed activation-sized blocks are reused instead of page-faulting fresh ones for every
    tensor (large CPU switches run faster); the process then keeps up to that much freed memory
    instead of returning it to the OS. When asked for, what was done is logged at INFO on this
    module's logger; by default nothing is changed and nothing is logged. GPU runs never touch
    the host allocator.
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and mixed_precision == "fp16":  # Accelerate would quietly run fp32 on a CPU
        raise UsageError(
            "--mixed-precision fp16 needs a CUDA GPU (on a CPU the steps would quietly run in "
            "fp32); use bf16 (CPU autocast) or no"
        )
    if cpu:
        _maybe_keep_freed_memory(keep_freed_memory)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **accelerator_kwargs)
    recognise_tied_weights(accelerator)  # no "Removed shared tensor" note for a tied head
    if strategy == "usp" and ulysses_size is None:
        ulysses_size = default_ulysses_size(sp_size)
    try:
        mesh = build_mesh(sp_size, accelerator, ulysses_size=ulysses_size)
    except ValueError as exc:
        # build_mesh (core.parallel) refuses the sizes given (--sp, a Ulysses degree, the
        # collective timeout) with a plain ValueError: bad input. Any other is a bug.
        if isinstance(exc, UsageError) or not str(exc).startswith(_MESH_INPUTS):
            raise
        raise UsageError(str(exc)) from exc
    if mesh.grad_group is not None:
        accelerator.ddp_handler = GroupDDPKwargs.on_group(mesh.grad_group, accelerator.ddp_handler)
    seed_everything(mesh, seed)
    return accelerator, mesh, SeqParallel(mesh, strategy, dim=sp_dim)


@dataclass
class GroupDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP kwargs plus the ``process_group`` DDP averages gradients on.

    ``accelerator.prepare`` passes ``to_kwargs()`` to ``DistributedDataParallel``; Accelerate's
    own handler has no ``process_group`` field (and deep-copies its fields, which a process
    group does not allow), so the group is kept out of ``to_dict`` and added here.
    """

    process_group: Any = None

    @classmethod
    def on_group(
        cls, group: Any, base: DistributedDataParallelKwargs | None = None
    ) -> GroupDDPKwargs:
        """``base``'s settings (the user's ``kwargs_handlers``, if any) with ``group``."""
        settings = {} if base is None else dict(vars(base))
        settings.pop("process_group", None)
        return cls(**settings, process_group=group)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")):
        own = {k: v for k, v in vars(self).items() if k != "process_group"}
        return {k: v for k, v in copy.deepcopy(own).items() if k not in ignore_keys}

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_kwargs()
        if self.process_group is not None:
            kwargs["process_group"] = self.process_group
        return kwargs


def default_ulysses_size(sp_size: int) -> int:
    """The Ulysses degree of a USP group: the smallest divisor ``u ≥ √N`` of ``N``, so the
    2-D group is as square as possible with Ulysses (4 units per stage) the larger factor."""
    return min(d for d in range(1, sp_size + 1) if sp_size % d == 0 and d * d >= sp_size)


def _maybe_keep_freed_memory(requested: bool | None) -> None:
    env = _env_asks_keep_freed_memory()  # a bad value is refused even when the argument wins
    if not (env if requested is None else requested):
        return  # the default: the process's allocator is left as it is, and nothing is said
    if perf.keep_freed_memory():
        gib = perf.DEFAULT_KEEP_LIMIT / 2**30
        logger.info(
            "dspzoo: set glibc malloc M_MMAP_THRESHOLD=%g GiB and M_TRIM_THRESHOLD=%g GiB "
            "(process-wide, as asked by %s) so freed CPU tensors are reused",
            gib,
            2 * gib,
            "setup_accelerate(keep_freed_memory=True)"
            if requested
            else f"{KEEP_FREED_MEMORY_ENV}={os.environ[KEEP_FREED_MEMORY_ENV]}",
        )
    else:
        logger.info(
            "dspzoo: left glibc malloc settings unchanged (allocator is not glibc or refused)"
        )

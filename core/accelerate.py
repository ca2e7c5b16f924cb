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
Accelerator is built with ``cpu=True`` and gloo (``--multi_gpu`` still starts N processes),
and glibc malloc's thresholds are raised process-wide (logged at INFO by the first rank of the
launch; opt out with ``keep_freed_memory=False`` or ``DSPZOO_KEEP_FREED_MEMORY=0``, see
:func:`setup_accelerate`). Accelerate's checkpoint note on a weight the model ties itself is
recognised and not printed (:mod:`dspzoo.core.quiet`).
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
from .parallel.mesh import SPMesh, build_mesh, seed_everything
from .parallel.runtime import SeqParallel
from .quiet import FirstRankOnly, recognise_tied_weights

logger = logging.getLogger(__name__)
logger.addFilter(FirstRankOnly())  # its lines are the same on every rank: say them once

KEEP_FREED_MEMORY_ENV = "DSPZOO_KEEP_FREED_MEMORY"
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def _env_allows_keep_freed_memory() -> bool:
    """``DSPZOO_KEEP_FREED_MEMORY``: unset or empty or 1/true/yes/on → allowed; 0/false/no/off → not."""
    value = os.environ.get(KEEP_FREED_MEMORY_ENV, "").strip().lower()
    if value in _FALSE:
        return False
    if value == "" or value in _TRUE:
        return True
    raise ValueError(
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
    keep_freed_memory: bool = True,
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
        keep_freed_memory: on CPU, call :func:`dspzoo.core.perf.keep_freed_memory`.

    **Process-wide side effect (CPU only).** By default, on CPU this raises glibc malloc's mmap
    and trim thresholds (``M_MMAP_THRESHOLD`` 1 GiB, ``M_TRIM_THRESHOLD`` 2 GiB) for the whole
    process, so freed activation-sized blocks are reused instead of page-faulting fresh ones
    for every tensor; the process then keeps up to that much freed memory instead of returning
    it to the OS. What was done is logged at INFO on this module's logger. Opt out with
    ``keep_freed_memory=False`` or the environment variable ``DSPZOO_KEEP_FREED_MEMORY=0``
    (``0/false/no/off``; either one disables it). GPU runs never touch the host allocator.
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and mixed_precision == "fp16":  # Accelerate would quietly run fp32 on a CPU
        raise ValueError(
            "--mixed-precision fp16 needs a CUDA GPU (on a CPU the steps would quietly run in "
            "fp32); use bf16 (CPU autocast) or no"
        )
    if cpu:
        _maybe_keep_freed_memory(keep_freed_memory)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **accelerator_kwargs)
    recognise_tied_weights(accelerator)  # no "Removed shared tensor" note for a tied head
    if strategy == "usp" and ulysses_size is None:
        ulysses_size = default_ulysses_size(sp_size)
    mesh = build_mesh(sp_size, accelerator, ulysses_size=ulysses_size)
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


def _maybe_keep_freed_memory(requested: bool) -> None:
    env_ok = _env_allows_keep_freed_memory()
    if not (requested and env_ok):
        why = (
            "keep_freed_memory=False"
            if not requested
            else f"{KEEP_FREED_MEMORY_ENV}={os.environ[KEEP_FREED_MEMORY_ENV]}"
        )
        logger.info("dspzoo: left glibc malloc settings unchanged (%s)", why)
        return
    if perf.keep_freed_memory():
        gib = perf.DEFAULT_KEEP_LIMIT / 2**30
        logger.info(
            "dspzoo: set glibc malloc M_MMAP_THRESHOLD=%g GiB and M_TRIM_THRESHOLD=%g GiB "
            "(process-wide) so freed CPU tensors are reused; opt out with "
            "setup_accelerate(keep_freed_memory=False) or %s=0",
            gib,
            2 * gib,
            KEEP_FREED_MEMORY_ENV,
        )
    else:
        logger.info(
            "dspzoo: left glibc malloc settings unchanged (allocator is not glibc or refused)"
        )

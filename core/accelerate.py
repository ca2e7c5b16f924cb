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
single-process gradients, so no extra scaling is needed. On a machine without CUDA the
Accelerator is built with ``cpu=True`` and gloo (``--multi_gpu`` still starts N processes).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from .mesh import SPMesh, build_mesh, seed_everything
from .perf import keep_freed_memory
from .runtime import SeqParallel


def setup_accelerate(
    sp_size: int,
    *,
    seed: int = 0,
    strategy: str = "dsp",
    mixed_precision: str = "no",
    cpu: bool | None = None,
    **accelerator_kwargs: Any,
) -> tuple[Accelerator, SPMesh, SeqParallel]:
    """Build ``(accelerator, mesh, sp)``, and seed RNGs per DP group.

    Args:
        sp_size: ranks per SP group; must divide the number of launched processes.
        seed: base seed; RNG is identical inside an SP group, distinct across DP groups.
        strategy: sequence-parallel strategy name.
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (GPU), passed to Accelerate.
        cpu: force CPU; default: CPU when CUDA is unavailable.

    On CPU it also calls :func:`dspzoo.core.perf.keep_freed_memory` (glibc reuses freed
    activation-sized blocks instead of page-faulting fresh ones for every tensor).
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu:
        keep_freed_memory()
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **accelerator_kwargs)
    mesh = build_mesh(sp_size, accelerator)
    seed_everything(mesh, seed)
    return accelerator, mesh, SeqParallel(mesh, strategy)

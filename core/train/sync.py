"""Gradient synchronisation: one policy for every domain, chosen by the strategy.

* A strategy that shards the weights (``megatron_sp``) takes the tensor-parallel path
  (:class:`~dspzoo.core.train.tensor_parallel.TensorParallelTraining`): no DDP, replicated
  gradients averaged and sharded ones reduced after the backward pass, full-tensor
  checkpoints.
* ``--fsdp`` (any strategy but ``megatron_sp``): FSDP2 ``fully_shard`` over the dp × sp world
  (:mod:`dspzoo.core.train.fsdp`): weights, gradients and optimizer state sharded, gradients
  averaged over the world as DDP would, on the same gradient communicator.
* Every other strategy: DDP over the whole dp × sp world. Under the gradient contract
  (:mod:`dspzoo.core.loss`) the world mean of the per-rank gradients is the data-parallel mean
  of single-process gradients, whatever the domain's loss (sharded or replicated).

DDP all-reduces gradient buckets while the backward pass still runs the model's own
collectives on the SP group; on one communicator the two would have to be issued in the same
order on every rank, which nothing enforces. So DDP runs on the mesh's gradient communicator
(:func:`gradient_group`), never on the SP group's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError
from .fsdp import FullyShardedTraining, ShardingSettings
from .tensor_parallel import TensorParallelTraining


def gradient_group(mesh: Any) -> Any:
    """DDP's process group.

    ``mesh.grad_group`` is a communicator of its own spanning the dp × sp world, separate from
    the SP and DP groups (see :mod:`dspzoo.core.parallel.mesh`); a mesh without that attribute (older
    meshes) gives ``None``: the default group.
    """
    return getattr(mesh, "grad_group", None)


class GradientSync:
    """The strategy's gradient synchronisation, behind the calls every training step makes::

    model = sync.shard(model)                    # before the optimizer
    model, optimizer = sync.prepare(model, optimizer)
    ...
    accelerator.backward(loss)
    sync.sync_and_clip(model, max_norm)          # before optimizer.step()
    final = sync.full_model(raw_model)           # collective
    """

    def __init__(
        self, accelerator: Any, mesh: Any, sp: Any, sharding: ShardingSettings | None = None
    ) -> None:
        """``sharding``: train under FSDP (``--fsdp``) with these settings; ``None``: DDP or
        the tensor-parallel path, as the strategy says."""
        self.accelerator, self.mesh = accelerator, mesh
        self.tp = TensorParallelTraining(accelerator, mesh, sp)
        if sharding is not None and self.tp.active:
            raise UsageError(
                f"--fsdp shards the weights over dp × sp, and --sp-strategy {sp.strategy.name} "
                f"shards them over the SP group already: drop --fsdp or pick another strategy"
            )
        self.fsdp = FullyShardedTraining(accelerator, mesh, sharding) if sharding else None
        # the path that shards weights, if any (both share the calls below)
        self.sharded: Any = self.tp if self.tp.active else None
        if self.fsdp is not None and self.fsdp.active:
            self.sharded = self.fsdp

    @property
    def method(self) -> str:
        """``"tensor-parallel"``, ``"fsdp"`` or ``"ddp"`` (for the logs)."""
        if self.sharded is None:
            return "ddp"
        return "tensor-parallel" if self.sharded is self.tp else "fsdp"

    def shard(self, model: nn.Module) -> nn.Module:
        """The strategy's weight shards of ``model`` (itself when nothing is sharded)."""
        return self.sharded.shard(model) if self.sharded is not None else model

    def prepare(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Device placement and mixed precision (Accelerate), then DDP on
        :func:`gradient_group` — or the sharded path's preparation."""
        if self.sharded is not None:
            return self.sharded.prepare(model, optimizer)
        model = self.accelerator.prepare_model(model, evaluation_mode=True)  # no wrapper yet
        if self.mesh.world_size > 1 and any(p.requires_grad for p in model.parameters()):
            cuda = self.accelerator.device.type == "cuda"
            model = DistributedDataParallel(
                model,
                device_ids=[self.accelerator.local_process_index] if cuda else None,
                process_group=gradient_group(self.mesh),
            )
        return model, self.accelerator.prepare_optimizer(optimizer)

    def sync_and_clip(self, model: nn.Module, max_norm: float) -> None:
        """After ``backward``: the synchronisation DDP does not do (tensor-parallel path),
        then the global gradient norm clipped to ``max_norm`` (0: off)."""
        (self.sharded or self.tp).sync_and_clip(model, max_norm)

    def local_parameters(self, model: nn.Module) -> list[torch.Tensor]:
        """This rank's parameter tensors (a sharded parameter's local shard), e.g. to leave
        them out of activation memory."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]

    def checkpointable(self, ema: Any) -> Any:
        """What to register for checkpointing for an EMA (full tensors when sharded)."""
        return self.sharded.checkpointable(ema) if self.sharded is not None else ema

    def full_model(self, model: nn.Module) -> nn.Module:
        """The whole unwrapped model with full weights (collective when sharded)."""
        return self.sharded.full_model(model) if self.sharded is not None else model

"""Gradient synchronisation: one policy for every domain, chosen by the strategy.

* A strategy that shards the weights (``megatron_sp``) takes the tensor-parallel path
  (:class:`~dspzoo.core.tensor_parallel_training.TensorParallelTraining`): no DDP, replicated
  gradients averaged and sharded ones reduced after the backward pass, full-tensor
  checkpoints.
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

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..tensor_parallel_training import TensorParallelTraining


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

    def __init__(self, accelerator: Any, mesh: Any, sp: Any) -> None:
        self.accelerator, self.mesh = accelerator, mesh
        self.tp = TensorParallelTraining(accelerator, mesh, sp)

    @property
    def method(self) -> str:
        """``"tensor-parallel"`` or ``"ddp"`` (for the logs)."""
        return "tensor-parallel" if self.tp.active else "ddp"

    def shard(self, model: nn.Module) -> nn.Module:
        """The strategy's weight shards of ``model`` (itself when nothing is sharded)."""
        return self.tp.shard(model)

    def prepare(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Device placement and mixed precision (Accelerate), then DDP on
        :func:`gradient_group` — or the tensor-parallel preparation."""
        if self.tp.active:
            return self.tp.prepare(model, optimizer)
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
        self.tp.sync_and_clip(model, max_norm)

    def checkpointable(self, ema: Any) -> Any:
        """What to register for checkpointing for an EMA (full tensors when sharded)."""
        return self.tp.checkpointable(ema)

    def full_model(self, model: nn.Module) -> nn.Module:
        """The whole unwrapped model with full weights (collective when sharded)."""
        return self.tp.full_model(model)

"""Sharded training (``--fsdp``): FSDP2 ``fully_shard`` over the dp × sp world.

Every rank keeps ``1 / world`` of each parameter, its gradient and its Adam moments; a block's
parameters are all-gathered just before the block runs (forward, and again in backward) and
its gradients reduce-scattered right after its backward. The gradients are averaged over the
whole dp × sp world — under the gradient contract (:mod:`dspzoo.core.loss`) that is what DDP
does, so ``--fsdp`` trains the same run as DDP at every layout.

**Units.** :func:`shard_units` picks the modules held in the model's outermost
``nn.ModuleList`` s (its blocks); each is one ``fully_shard`` unit, and the root holds the
rest (embeddings, heads). A Task may pick others (:meth:`~dspzoo.core.train.task.Task.fsdp_units`;
protein takes :func:`sublayer_units`, as its blocks begin on overlapped switches). FSDP's all-gathers and reduce-scatters run on the mesh's gradient
communicator (``mesh.grad_group``), never on the SP group's: the model's own SP collectives
run on that one in the middle of every block.

**Mixed precision.** ``--mixed-precision bf16`` (or ``fp16``) becomes FSDP's policy: the
all-gathered parameters and the block's compute in that precision, gradients reduced and the
sharded parameters kept in fp32.

**Activation checkpointing** (``--activation-checkpointing``): each unit keeps only its inputs
and recomputes its forward during backward (the SP collectives inside it run again, in the
same order on every rank; keyed dropout draws the same masks).

**Checkpoints hold full tensors**, as under every other strategy: the sharded model's
``state_dict()`` gives full tensors (a post hook; collective, so every rank calls it, as
Accelerate's ``save_state`` and its loading of ``model.safetensors`` do), the optimizer's and
the EMA's states their full moments and averages (gathered on every rank, in parameter order);
loading keeps this rank's shard of each full tensor (no communication). So a checkpoint resumes at any dp × sp layout, with or without
``--fsdp``, and the final model is a plain ``save_pretrained`` folder (the model's class rebuilt from its
config); ``--init-from`` loads full weights before sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError

PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules of the model's outermost ``nn.ModuleList`` s, in order (its blocks)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units


def sublayer_units(model: nn.Module) -> list[nn.Module]:
    """The children with parameters of every block (:func:`shard_units`): for a model whose
    block takes an activation the plan may still be switching when the block begins (an
    overlapped switch); FSDP re-wraps a unit's tensor inputs, which the block must not see."""
    return [
        child
        for block in shard_units(model)
        for child in block.children()
        if any(True for _ in child.parameters())
    ]


@dataclass(frozen=True)
class ShardingSettings:
    """What ``--fsdp`` runs with: the autocast precision name, activation checkpointing, and
    which modules are the ``fully_shard`` units (default: the blocks)."""

    mixed_precision: str = "no"
    activation_checkpointing: bool = False
    units: Callable[[nn.Module], list[nn.Module]] = shard_units


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: Any) -> Any:
    """The full tensor of a DTensor (collective over its mesh); anything else as it is.

    An unevenly sharded tensor comes back as a view into the padded all-gather buffer, which
    safetensors refuses to save (a storage larger than the tensor): such a view is copied.
    """
    if not _is_dtensor(t):
        return t
    full = t.full_tensor()
    if full.untyped_storage().nbytes() != full.numel() * full.element_size():
        full = full.clone()
    return full


def _shard_like(full: torch.Tensor, like: Any) -> Any:
    """This rank's shard of ``full`` laid out as DTensor ``like`` (no communication); a tensor
    that is not the full shape of ``like`` (or ``like`` not a DTensor) is kept as it is."""
    from torch.distributed.tensor import distribute_tensor

    if not _is_dtensor(like) or _is_dtensor(full) or tuple(full.shape) != tuple(like.shape):
        return full
    full = full.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


class FullyShardedTraining:
    """The ``--fsdp`` path behind :class:`~dspzoo.core.train.sync.GradientSync`'s calls.

    Inactive (``active`` false, every call a no-op) on a single process.
    """

    def __init__(self, accelerator: Any, mesh: Any, settings: ShardingSettings) -> None:
        self.accelerator, self.mesh, self.settings = accelerator, mesh, settings
        self.active = mesh.world_size > 1
        self.model: nn.Module | None = None
        self.plain_class: type[nn.Module] = nn.Module
        self._device_mesh: Any = None

    @property
    def device_mesh(self) -> Any:
        """A 1-D DeviceMesh over the mesh's gradient communicator (built on first use)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            from .sync import gradient_group

            group = gradient_group(self.mesh) or dist.group.WORLD
            device = self.accelerator.device.type
            self._device_mesh = DeviceMesh.from_group(group, device)
        return self._device_mesh

    # -- setup ----------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` every unit (:func:`shard_units`), then the root; optionally with
        activation checkpointing of every unit. Every rank must hold the same full weights."""
        if not self.active:
            return model
        from torch.distributed._composable import checkpoint
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ..parallel.context import recompute_contexts

        if not hasattr(model, "config"):
            raise UsageError(
                f"--fsdp: {type(model).__name__} has no .config; the final model is rebuilt "
                f"as {type(model).__name__}(model.config) with the full weights"
            )
        self.plain_class = type(model)  # fully_shard swaps the class for an FSDP subclass
        model = model.to(self.accelerator.device)
        low = PRECISIONS[self.settings.mixed_precision]
        policy = MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32 if low is not None else None
        )
        for unit in self.settings.units(model):
            if self.settings.activation_checkpointing:  # recomputed in the region it ran in
                checkpoint(unit, context_fn=recompute_contexts)
            fully_shard(unit, mesh=self.device_mesh, mp_policy=policy)
        fully_shard(model, mesh=self.device_mesh, mp_policy=policy)
        model.register_state_dict_post_hook(_full_state_dict)
        model.register_load_state_dict_pre_hook(self._shards_on_load)
        self.model = model
        return model

    def prepare(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Register the model with Accelerate (no DDP) and the checkpoint hooks."""
        if model is not self.model:
            raise ValueError("prepare: pass the model returned by shard()")
        model = self.accelerator.prepare_model(model, evaluation_mode=True)  # no wrapper
        optimizer = self.accelerator.prepare_optimizer(optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.register_state_dict_post_hook(self._full_optimizer_state)
        inner.register_load_state_dict_pre_hook(self._local_optimizer_state)
        return model, optimizer

    def checkpointable(self, ema: Any) -> Any:
        """What to ``register_for_checkpointing`` for an EMA of the sharded parameters."""
        return _FullStateEMA(ema)

    # -- every step -----------------------------------------------------------------------------
    @torch.no_grad()
    def sync_and_clip(self, model: nn.Module, max_norm: float) -> None:
        """FSDP reduced the gradients during backward; clip their global norm (0: off).

        Each element of a gradient lives in exactly one rank's shard: the squares of the
        local shards summed over the world are the global squared norm.
        """
        if not max_norm:
            return
        self.accelerator.unscale_gradients()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if _is_dtensor(g) else g for g in grads]
        squares = torch.zeros(1, dtype=torch.float64, device=local[0].device)
        for g in local:
            squares += torch.linalg.vector_norm(g.float(), 2).double() ** 2
        dist.all_reduce(squares, group=self.device_mesh.get_group())
        coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))

    # -- full tensors -----------------------------------------------------------------------------
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict with full tensors (collective, every rank)."""
        return dict(model.state_dict())  # full tensors: _full_state_dict

    def full_model(self, model: nn.Module) -> nn.Module:
        """A plain copy of ``model`` with full weights (collective): its class before
        sharding, built from ``model.config``, loaded with the full tensors."""
        state = self.full_state(model)
        plain = self.plain_class(model.config).to(self.accelerator.device)
        plain.load_state_dict(state)
        return plain

    # -- checkpoint hooks -------------------------------------------------------------------------
    def _shards_on_load(self, module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        """``load_state_dict`` pre hook of the root: full tensors → this rank's shards."""
        own = dict(module.named_parameters())
        own.update(module.named_buffers())
        for name, like in own.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = _shard_like(state_dict[key], like)

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _full_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        state = {}
        for index in sorted(state_dict["state"]):  # the same order on every rank
            entries = state_dict["state"][index]
            state[index] = {key: _full(v) for key, v in sorted(entries.items())}
        return {**state_dict, "state": state}

    def _local_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        params = self._params(optimizer)
        state = {}
        for index, entries in state_dict["state"].items():
            param = params[int(index)]
            state[index] = {
                key: _shard_like(v, param) if isinstance(v, torch.Tensor) and v.dim() else v
                for key, v in entries.items()
            }
        return {**state_dict, "state": state}


def _full_state_dict(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """``state_dict`` post hook of the sharded root: full tensors in place of the shards.

    Collective (an all-gather per tensor, in the state dict's order on every rank), so every
    rank calls ``state_dict()``: Accelerate's ``save_state`` and the loading of
    ``model.safetensors`` (which compares the model's state dict with the file's) both do.
    """
    for key in list(state_dict):
        if key.startswith(prefix):
            state_dict[key] = _full(state_dict[key])


class _FullStateEMA:
    """Checkpoints an :class:`~dspzoo.core.train.ema.EMA` of sharded parameters with full
    averages (gathered on save, this rank's shards kept on load)."""

    def __init__(self, ema: Any) -> None:
        self.ema = ema

    def state_dict(self) -> dict[str, Any]:
        state = self.ema.state_dict()
        return {**state, "shadow": {k: _full(v) for k, v in state["shadow"].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = {
            k: _shard_like(v, self.ema.shadow[k]) if k in self.ema.shadow else v
            for k, v in state["shadow"].items()
        }
        self.ema.load_state_dict({**state, "shadow": shadow})

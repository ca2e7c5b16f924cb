"""Training under a strategy that shards the model's weights (``megatron_sp``), like any other.

The Trainer's gradient synchronisation (:class:`dspzoo.core.train.sync.GradientSync`) makes
these calls whatever the strategy; they only do something special when the strategy shards
weights (:attr:`TensorParallelTraining.active`), and otherwise the Trainer runs DDP::

    tp = TensorParallelTraining(accelerator, mesh, sp)
    model = tp.shard(build_model(cfg))                 # parallelize_megatron, before the optimizer
    optimizer = ...(model.parameters())
    model, optimizer = tp.prepare(model, optimizer)    # DDP, or no DDP + full-tensor checkpoints
    accelerator.register_for_checkpointing(tp.checkpointable(ema))
    ...
    accelerator.backward(loss)
    tp.sync_and_clip(model, max_norm)                  # after backward, before optimizer.step()
    ...
    final = tp.full_model(raw_model)                   # collective: the whole model, to save

Without weight sharding these are ``accelerator.prepare`` (DDP averages gradients over
dp × sp) and ``accelerator.clip_grad_norm_``. With it:

**No DDP.** DDP would broadcast rank 0's shards at construction and average different shards;
the model is prepared with ``evaluation_mode=True`` (device placement and mixed precision,
no wrapper) and :func:`~dspzoo.core.parallel.methods.megatron.megatron_grad_sync` runs after backward
instead (replicated gradients summed over dp × sp, sharded ones over dp, both divided by
dp · sp).

**Gradient norm.** After the sync, replicated gradients are identical on every rank and a
sharded parameter's pieces are spread over its SP group (and repeated across DP groups). The
global norm is ``sqrt(Σ_replicated ‖g‖² + Σ_SP-group Σ_sharded ‖g‖²)``: each rank adds its
replicated gradients' squares locally (counted once, not N times) and its shards' squares,
summed over the SP group with one all-reduce (each shard counted exactly once; no DP sum,
the DP groups hold the same values). Clipping then scales every gradient by
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.

**Checkpoints hold full tensors**, exactly as under every other strategy, so a checkpoint
resumes at any layout under any strategy, in both directions:

* saving (Accelerate's ``save_state`` calls these on every rank, so they may communicate):
  the model's shards are replaced by :func:`~dspzoo.core.parallel.methods.megatron.gather_full`'s full
  tensors in the saved weights; the optimizer's ``state_dict`` (a post hook) and the EMA's
  (:meth:`checkpointable`) gather every per-parameter state tensor of a shard (Adam moments,
  averages) the same way;
* loading slices: each parallel linear has a ``load_state_dict`` pre hook keeping its rows
  (column-parallel) or columns (row-parallel) of a full tensor, and the optimizer and EMA
  states are sliced likewise (a tensor that already has the shard's shape is kept as it is).

The EMA needs nothing else: its update is element-wise, so each rank averages its own shards.

Limit: fp16 loss scaling (a GPU-only mode) checks for inf/NaN per rank; with sharded gradients
the ranks could disagree on skipping a step. bf16 and fp32 have no scaler.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.comm import all_reduce_sum, group_size
from ..parallel.methods.megatron import (
    METHOD,
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full,
    megatron_grad_sync,
    parallelize_megatron,
    sharded_parameters,
)
from ..parallel.tp_contract import check_tp_contract

# strategies whose models hold shards of the weights (parallelize_megatron)
WEIGHT_SHARDING = (METHOD,)

_Parallel = ColumnParallelLinear | RowParallelLinear


def _is_shard(module: nn.Module, p_name: str) -> bool:
    """Whether ``module.<p_name>`` holds a shard (a row-parallel bias is replicated)."""
    return isinstance(module, _Parallel) and not (
        isinstance(module, RowParallelLinear) and p_name == "bias"
    )


def _full_shape(module: nn.Module, p_name: str) -> tuple[int, ...]:
    return (module.tp_full[0],) if p_name == "bias" else tuple(module.tp_full)


def _local(full: torch.Tensor, module: nn.Module, p_name: str) -> torch.Tensor:
    """This rank's piece of the ``full`` tensor of ``module.<p_name>`` (a shard's shape: kept)."""
    if tuple(full.shape) != _full_shape(module, p_name):
        return full
    index = module.tp_index.to(full.device)
    if isinstance(module, ColumnParallelLinear):
        return full.index_select(0, index)
    return full.index_select(1, index)


def _slice_on_load(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre hook of a parallel linear: full tensors → this rank's shard."""
    for p_name in ("weight", "bias"):
        key = prefix + p_name
        if key in state_dict and _is_shard(module, p_name):
            state_dict[key] = _local(state_dict[key], module, p_name)


class TensorParallelTraining:
    """What a training script does differently when the strategy shards the weights.

    See the module docstring; every method is the plain data-parallel behaviour when
    :attr:`active` is false.
    """

    def __init__(self, accelerator: Any, mesh: Any, sp: Any) -> None:
        self.accelerator, self.mesh, self.sp = accelerator, mesh, sp
        self.active = sp.strategy.name in WEIGHT_SHARDING
        self.model: nn.Module | None = None

    # -- setup ----------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """Replace the model's ``TP_PLAN`` linears by this rank's shards (in place).

        Every rank must hold the same full weights (seeded init). Call before building the
        optimizer. Loading a full state dict into the result slices it.
        """
        if not self.active:
            return model
        check_tp_contract(model)  # one clear line, not an error deep in the first forward
        parallelize_megatron(model, self.sp.group)
        for module in model.modules():
            if isinstance(module, _Parallel):
                module.register_load_state_dict_pre_hook(_slice_on_load)
        self.model = model
        return model

    def prepare(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """``accelerator.prepare`` without DDP for a sharded model, with full-tensor checkpoints."""
        if not self.active:
            return self.accelerator.prepare(model, optimizer)
        if model is not self.model:
            raise ValueError("prepare: pass the model returned by shard()")
        model = self.accelerator.prepare_model(model, evaluation_mode=True)  # no DDP
        optimizer = self.accelerator.prepare_optimizer(optimizer)
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.register_state_dict_post_hook(self._full_optimizer_state)
        inner.register_load_state_dict_pre_hook(self._local_optimizer_state)
        self.accelerator.register_save_state_pre_hook(self._full_weights)
        return model, optimizer

    def checkpointable(self, ema: Any) -> Any:
        """What to ``register_for_checkpointing`` for ``ema``: itself, or a full-tensor view."""
        return _FullStateEMA(ema, self) if self.active else ema

    # -- every step -----------------------------------------------------------------------------
    def sync_and_clip(self, model: nn.Module, max_norm: float) -> None:
        """After ``accelerator.backward``: the gradient sync DDP does not do, then clipping of
        the global gradient norm to ``max_norm`` (0: off)."""
        if not self.active:
            if max_norm:
                self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
            return
        megatron_grad_sync(model, self.mesh)
        if max_norm:
            self.accelerator.unscale_gradients()
            clip_sharded_grad_norm_(model, max_norm, self.sp.group)

    # -- full tensors -----------------------------------------------------------------------------
    def full_model(self, model: nn.Module) -> nn.Module:
        """``model`` with whole linears and full weights (a copy; collective). ``model`` itself
        when nothing is sharded."""
        if not self.active:
            return model
        weights = gather_full(model, self.sp.group)
        full = copy.deepcopy(model)
        for name, module in list(full.named_modules()):
            if isinstance(module, _Parallel):
                parent, _, attr = name.rpartition(".")
                out_features, in_features = module.tp_full
                kind = {"device": module.weight.device, "dtype": module.weight.dtype}
                whole = nn.Linear(in_features, out_features, module.bias is not None, **kind)
                setattr(full.get_submodule(parent), attr, whole)
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(weights[name])
        return full

    def _owners(self) -> dict[str, tuple[nn.Module, str]]:
        """Parameter name (tied ones under every name) → ``(module, parameter name in it)``."""
        return {
            f"{mod_name}.{p_name}" if mod_name else p_name: (module, p_name)
            for mod_name, module in self.model.named_modules()
            for p_name, _ in module.named_parameters(recurse=False)
        }

    def _gather(self, t: torch.Tensor, module: nn.Module, p_name: str) -> torch.Tensor:
        """The full tensor of which ``t`` is this rank's piece (collective over the SP group)."""
        pieces = [(module.tp_index, t.detach().cpu())]
        if group_size(self.sp.group) > 1:
            pieces = [None] * group_size(self.sp.group)
            dist.all_gather_object(pieces, (module.tp_index, t.detach().cpu()), group=self.sp.group)
        full = torch.zeros(_full_shape(module, p_name), dtype=t.dtype)
        for index, piece in pieces:
            if isinstance(module, ColumnParallelLinear):
                full[index] = piece
            else:
                full[:, index] = piece
        return full.to(t.device)

    def full_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter tensors by parameter name (shard-shaped) → full ones (collective)."""
        owners = self._owners()
        out = {}
        for name, t in tensors.items():  # the same names in the same order on every rank
            module, p_name = owners[name]
            out[name] = self._gather(t, module, p_name) if _is_shard(module, p_name) else t
        return out

    def local_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter full tensors by name → this rank's pieces."""
        owners = self._owners()
        return {
            name: _local(t, *owners[name]) if _is_shard(*owners[name]) else t
            for name, t in tensors.items()
        }

    # -- checkpoint hooks -------------------------------------------------------------------------
    def _full_weights(self, models: list, weights: list[dict], output_dir: str) -> None:
        """Accelerate ``save_state`` pre hook (every rank): full tensors in the saved weights."""
        for model, state in zip(models, weights, strict=True):
            if model is self.model:
                for name, full in gather_full(model, self.sp.group).items():
                    if name in state:
                        state[name] = full.to(state[name].device)

    def _by_index(self, optimizer: torch.optim.Optimizer) -> list[tuple[nn.Module, str] | None]:
        """Owner of each optimizer state index (``state_dict`` numbers parameters in order)."""
        owner_of = {id(_param(*owner)): owner for owner in self._owners().values()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return [owner_of.get(id(p)) for p in params]

    def _full_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        owners = self._by_index(optimizer)
        state = {}
        for index in sorted(state_dict["state"]):  # the same order on every rank
            owner = owners[index]
            state[index] = {
                key: self._gather(v, *owner)
                if owner is not None and _is_shard(*owner) and _is_moment(v, owner)
                else v
                for key, v in sorted(state_dict["state"][index].items())
            }
        return {**state_dict, "state": state}

    def _local_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        owners = self._by_index(optimizer)
        state = {}
        for index, entries in state_dict["state"].items():
            owner = owners[index]
            state[index] = {
                key: _local(v, *owner)
                if owner is not None and _is_shard(*owner) and isinstance(v, torch.Tensor)
                else v
                for key, v in entries.items()
            }
        return {**state_dict, "state": state}


def _param(module: nn.Module, p_name: str) -> torch.Tensor:
    return getattr(module, p_name)


def _is_moment(v: Any, owner: tuple[nn.Module, str]) -> bool:
    """A per-element optimizer state of the shard (shaped like it), not a scalar like ``step``."""
    return isinstance(v, torch.Tensor) and v.shape == _param(*owner).shape and v.dim() > 0


class _FullStateEMA:
    """Checkpoints an :class:`~dspzoo.core.train.ema.EMA` of a sharded model with full averages."""

    def __init__(self, ema: Any, tp: TensorParallelTraining) -> None:
        self.ema, self.tp = ema, tp

    def state_dict(self) -> dict[str, Any]:
        state = self.ema.state_dict()
        return {**state, "shadow": self.tp.full_tensors(state["shadow"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict({**state, "shadow": self.tp.local_tensors(state["shadow"])})


@torch.no_grad()
def clip_sharded_grad_norm_(model: nn.Module, max_norm: float, group: Any) -> torch.Tensor:
    """Clip the gradients of a ``parallelize_megatron`` model (after ``megatron_grad_sync``) to
    a global norm of ``max_norm``; returns the norm before clipping.

    Replicated gradients' squares are counted once; sharded ones are summed over ``group``.
    """
    sharded = sharded_parameters(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # replicated, sharded
    for p in model.parameters():
        if p.grad is not None:
            norm = torch.linalg.vector_norm(p.grad.float(), 2).double()
            squares[int(id(p) in sharded)] += norm.to(device) ** 2
    total = (squares[0] + all_reduce_sum(squares[1:], group)[0]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total

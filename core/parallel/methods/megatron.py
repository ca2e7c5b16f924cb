"""Megatron-SP: Megatron-LM tensor parallelism with sequence parallelism over the SP group.

The baseline the DSP paper compares with. Outside attention and MLP blocks (LayerNorm,
residuals, modulation, everything token-wise) activations stay sharded on one sequence dim.
Each block is a pair of linears:

* **enter** (``sp.tp_enter``): all-gather the sequence (backward: reduce-scatter);
* **column-parallel** input linear (``qkv``, ``fc1``): rank ``r`` holds the output features of
  its heads / hidden units, ``shard_sizes(H, N)[r]`` of them (uneven allowed, ``H < N``
  refused); q, k and v are stacked, so each third of ``qkv`` is sharded by heads;
* attention over the full sequence for the local heads: no further communication (the spec
  after ``tp_enter`` is replicated, so the dispatcher runs it locally);
* **row-parallel** output linear (``proj``, ``fc2``) via ``sp.tp_exit``: rank ``r`` holds the
  input features of its heads / units and produces a partial sum of the full output, which is
  reduce-scattered onto the sequence sharding (backward: all-gather); its bias is added once,
  after the reduction.

Communication per linear pair, per rank, each way: one all-gather and one reduce-scatter of
the block's input/output activation ``M`` (``B·L·C`` elements), ``(N−1)/N·M`` elements each
(padded to the longest shard when ``N`` does not divide the sharded length); the backward
mirrors it (reduce-scatter of the input gradient, all-gather of the output gradient).

Models stay strategy-free. A module declares which of its linears are which in a class
attribute ``TP_PLAN``, e.g. ``{"qkv": ("column", 3), "proj": "row"}`` on
:class:`~dspzoo.core.layers.attention.SeqSelfAttention` (``3``: q, k, v stacked) and
``{"fc1": "column", "fc2": "row"}`` on :class:`~dspzoo.core.layers.mlp.Mlp`, calls the two hooks
around them, and reads its local head count from the weight shape.
:func:`parallelize_megatron` replaces the declared linears by their local shards. The shard
unit is a *head* (``out_features / groups / module.heads`` rows) when the module has a
``heads`` attribute, else a single feature (MLP hidden unit); a column linear and its row
partner must declare the same units.

Gradients
---------
The project's contract (``docs/gradient_contract.md``): collectives have exact adjoints, and the
per-rank losses ``L_r`` of an SP group satisfy ``(1/N)·Σ_r L_r = L`` (the full-sample loss).
Then autograd on rank ``r`` computes ``∂J/∂θ_r`` with ``J = Σ_r L_r = N·L`` and ``θ_r`` the
tensor rank ``r`` holds. The all-gather / reduce-scatter pairs above are exact adjoints of
each other, so the contract holds here too:

* a **replicated** parameter (LayerNorm, embeddings, row-parallel biases) has a copy on every
  rank, ``Σ_r ∂J/∂θ_r = ∂J/∂θ = N·∂L/∂θ``; the SP mean is ``∂L/∂θ`` (as under every strategy);
* a **sharded** parameter (column weights and biases, row weights) exists on one rank only, so
  its local gradient is the whole ``∂J/∂θ_r = N·∂L/∂θ_r``: it must be **divided by N**, and
  must never be averaged with other ranks' (different) shards.

With data parallelism (``D`` SP groups, losses ``L_d``, target ``(1/D)·Σ_d ∂L_d/∂θ``) both
become *sum, then divide by the world size* ``D·N``: a replicated gradient is summed over the
whole ``dp × sp`` world (the SP group, then the DP group), a sharded one over its DP group
only. :func:`megatron_grad_sync` does exactly that; call it after ``backward()`` **instead of
DDP** (DDP over the world would broadcast rank 0's shards at construction and average
different shards; DDP over the DP group alone would miss both the ``1/N`` of the shards and
the SP mean of the replicated parameters).

Every rank must start from the same full parameters (seeded init or a loaded checkpoint)
before :func:`parallelize_megatron`; :func:`gather_full` reassembles full tensors (parameters
or gradients) for checkpoints and tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..comm import gather_for_local_use
from ..comm.group import group_rank, group_size
from ..comm.replicate import all_gather_along, reduce_scatter_along
from ..layout import SeqSpec, shard_offset, shard_sizes
from ..trace import comm_region, current_region

METHOD = "megatron_sp"


class ColumnParallelLinear(nn.Linear):
    """This rank's output features of a column-parallel linear (weight and bias sharded).

    ``tp_index``: the rows of the full weight held here; ``tp_full``: the full weight's shape.
    """

    tp_index: torch.Tensor
    tp_full: tuple[int, int]
    tp_size: int


class RowParallelLinear(nn.Linear):
    """This rank's input features of a row-parallel linear (weight sharded, bias replicated).

    Call it through ``sp.tp_exit(linear, y, spec)``, which reduces the partial sums before
    adding the bias; calling it directly is refused unless it holds the whole weight.
    """

    tp_index: torch.Tensor
    tp_full: tuple[int, int]
    tp_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        raise RuntimeError(
            "a row-parallel linear (parallelize_megatron) gives partial sums; call it through "
            "sp.tp_exit(linear, y, spec) under the 'megatron_sp' strategy"
        )


def _style(entry: Any) -> tuple[str, int]:
    """A ``TP_PLAN`` entry → ``(style, groups)``: ``"row"``, ``"column"`` or ``("column", k)``."""
    style, groups = (entry, 1) if isinstance(entry, str) else (entry[0], int(entry[1]))
    if style not in ("column", "row") or groups < 1 or (style == "row" and groups != 1):
        raise ValueError(f"bad TP_PLAN entry {entry!r}: use 'column', ('column', k) or 'row'")
    return style, groups


def shard_index(features: int, groups: int, units: int, parts: int, rank: int) -> torch.Tensor:
    """The features of ``rank``: in each of ``groups`` equal groups, its ``units`` shard.

    ``features`` splits into ``groups`` stacked groups (q, k, v: 3) of ``units`` equal units
    (heads, or single features); rank ``r`` holds units ``shard_sizes(units, parts)[r]`` of
    every group, in order.
    """
    per_group, rem = divmod(features, groups)
    unit, rem_unit = divmod(per_group, units)
    if rem or rem_unit:
        raise ValueError(
            f"{features} features do not split into {groups} group(s) of {units} equal units"
        )
    start = shard_offset(units, parts, rank) * unit
    count = shard_sizes(units, parts)[rank] * unit
    return torch.cat(
        [torch.arange(g * per_group + start, g * per_group + start + count) for g in range(groups)]
    )


def _shard_linear(
    linear: nn.Module, style: str, groups: int, units: int, parts: int, rank: int
) -> nn.Linear:
    """The local shard of ``linear`` as a :class:`ColumnParallelLinear` / :class:`RowParallelLinear`."""
    weight, bias = linear.weight, linear.bias
    features = weight.shape[0] if style == "column" else weight.shape[1]
    index = shard_index(features, groups, units, parts, rank).to(weight.device)
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    kind = {"device": weight.device, "dtype": weight.dtype}
    if style == "column":
        new = cls(weight.shape[1], index.numel(), bias=bias is not None, **kind)
        local_w, local_b = weight[index], None if bias is None else bias[index]
    else:
        new = cls(index.numel(), weight.shape[0], bias=bias is not None, **kind)
        local_w, local_b = weight[:, index], bias
    with torch.no_grad():
        new.weight.copy_(local_w)
        if local_b is not None:
            new.bias.copy_(local_b)
    new.weight.requires_grad_(weight.requires_grad)
    if bias is not None:
        new.bias.requires_grad_(bias.requires_grad)
    new.tp_index, new.tp_full, new.tp_size = index.cpu(), tuple(weight.shape), parts
    return new


def parallelize_megatron(model: nn.Module, group: Any) -> nn.Module:
    """Replace every linear a module declares in ``TP_PLAN`` by this rank's shard (in place).

    ``group``: the SP group (``sp.group``; ``None``: one rank, the shards are whole). Raises a
    clear error when a module has fewer heads (or hidden units) than ranks. Returns ``model``.
    """
    parts, rank = group_size(group), group_rank(group)
    for owner_name, module in list(model.named_modules()):
        plan = getattr(type(module), "TP_PLAN", None)
        if not plan:
            continue
        for name, entry in plan.items():
            style, groups = _style(entry)
            linear = getattr(module, name)
            where = f"{owner_name or type(model).__name__}.{name}"
            if isinstance(linear, ColumnParallelLinear | RowParallelLinear):
                raise ValueError(f"{where} is already parallelized")
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{where} is declared in TP_PLAN but is not an nn.Linear")
            features = linear.out_features if style == "column" else linear.in_features
            heads = getattr(module, "heads", None)
            units = heads if heads is not None else features // groups
            if units < parts:
                what = "heads" if heads is not None else "features"
                raise ValueError(
                    f"megatron_sp: {where} has {units} {what}, fewer than the {parts} ranks of "
                    f"the SP group; every rank needs at least one (use at most {units} ranks, "
                    f"or a sequence-parallel strategy such as ring or dsp)"
                )
            setattr(module, name, _shard_linear(linear, style, groups, units, parts, rank))
    return model


def sharded_parameters(model: nn.Module) -> set[int]:
    """``id`` s of the parameters that hold a shard (column weights/biases, row weights)."""
    out: set[int] = set()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            out.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):
            out.add(id(module.weight))
    return out


def _all_reduce(tensors: list[torch.Tensor], groups: list[Any]) -> None:
    """Sum ``tensors`` in place over each of ``groups`` in turn (one flat buffer per group)."""
    groups = [g for g in groups if g is not None and group_size(g) > 1]
    if not tensors or not groups:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    for g in groups:
        dist.all_reduce(flat, group=g)
    start = 0
    for t in tensors:
        t.copy_(flat[start : start + t.numel()].view_as(t))
        start += t.numel()


@torch.no_grad()
def megatron_grad_sync(model: nn.Module, mesh: Any) -> None:
    """After ``backward()``, make every gradient the data-parallel mean of the full gradient.

    Replicated parameters: summed over the SP and DP groups; sharded ones: over the DP group
    only; both then divided by ``dp_size · sp_size`` (derivation in the module docstring).
    Missing gradients count as zero (so every rank issues the same collectives).
    """
    sp_group = None if mesh is None else mesh.sp_group
    dp_group = None if mesh is None else mesh.dp_group
    world = 1 if mesh is None else mesh.dp_size * mesh.sp_size
    sharded = sharded_parameters(model)
    rep, shd = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (shd if id(p) in sharded else rep).append(p.grad)
    by_dtype: dict[tuple[torch.dtype, torch.device, bool], list[torch.Tensor]] = {}
    for grads, is_sharded in ((rep, False), (shd, True)):
        for g in grads:
            by_dtype.setdefault((g.dtype, g.device, is_sharded), []).append(g)
    for (_, _, is_sharded), grads in by_dtype.items():
        _all_reduce(grads, [dp_group] if is_sharded else [sp_group, dp_group])
        for g in grads:
            g.div_(world)


@torch.no_grad()
def gather_full(model: nn.Module, group: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter (or gradient, ``grads=True``), by name.

    Collective over ``group``; every rank gets the same dict (on the CPU).
    """
    out: dict[str, torch.Tensor] = {}
    parts = group_size(group)
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            t = p.grad if grads else p
            t = torch.zeros_like(p) if t is None else t.detach()
            t = t.cpu()
            parallel = isinstance(module, ColumnParallelLinear | RowParallelLinear)
            if not parallel or (isinstance(module, RowParallelLinear) and p_name == "bias"):
                out[name] = t.clone()
                continue
            pieces = [(module.tp_index, t)]
            if parts > 1:
                pieces = [None] * parts
                dist.all_gather_object(pieces, (module.tp_index, t), group=group)
            column = isinstance(module, ColumnParallelLinear)
            shape = (module.tp_full[0],) if p_name == "bias" else module.tp_full
            full = torch.zeros(shape, dtype=t.dtype)
            for index, piece in pieces:
                if column:
                    full[index] = piece
                else:
                    full[:, index] = piece
            out[name] = full
    return out


# -- the two communication steps ---------------------------------------------------------------
def _check_layout(spec: SeqSpec) -> None:
    if spec.sharded is None:
        raise ValueError(
            "megatron_sp: the activation is replicated; tensor parallelism needs it sharded on "
            "a sequence dim (enter the model through sp.enter)"
        )
    layout = getattr(spec, "layout", "contiguous")
    if layout != "contiguous":
        raise ValueError(f"megatron_sp needs contiguous shards, got the {layout!r} layout")


def gather_sequence(x: torch.Tensor, spec: SeqSpec, group: Any) -> tuple[torch.Tensor, SeqSpec]:
    """Sharded ``x`` → the full sequence (backward: reduce-scatter) and its replicated spec."""
    _check_layout(spec)
    dim = spec.sharded
    with comm_region("tp"):
        full = gather_for_local_use(x, spec.axis(dim), group, spec.length(dim))
    return full, spec.with_sharded(None)


def row_parallel_output(
    linear: nn.Module, y: torch.Tensor, spec: SeqSpec, group: Any
) -> torch.Tensor:
    """``linear(y)`` for a row-parallel ``linear`` on the full sequence ``y``, laid out as
    ``spec``: partial sums reduce-scattered onto the sharded dim, then the bias, once."""
    if not isinstance(linear, RowParallelLinear):
        raise TypeError(
            f"megatron_sp: the output linear is a {type(linear).__name__}, not a row-parallel "
            f"shard; call parallelize_megatron(model, sp.group) before running the model"
        )
    _check_layout(spec)
    dim = spec.sharded
    partial = F.linear(y, linear.weight)
    with comm_region("tp"):
        out = _ReduceScatter.apply(
            partial, spec.axis(dim), group, spec.length(dim), current_region()
        )
    return out if linear.bias is None else out + linear.bias


class _ReduceScatter(torch.autograd.Function):
    """Full partial sums → this rank's shard of their sum; backward: all-gather (its adjoint)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, axis: int, group: Any, length: int, region: str
    ) -> torch.Tensor:
        sizes = shard_sizes(length, group_size(group))
        if x.shape[axis] != length:
            raise ValueError(
                f"megatron_sp: the output has {x.shape[axis]} rows on axis {axis}, expected the "
                f"full length {length}"
            )
        ctx.axis, ctx.group, ctx.sizes, ctx.region = axis, group, sizes, region
        return reduce_scatter_along(x, axis, sizes, group, region, phase="forward").contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gathered = all_gather_along(grad, ctx.axis, ctx.sizes, ctx.group, ctx.region, "backward")
        return gathered, None, None, None, None

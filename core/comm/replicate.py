"""Replicated ↔ sharded: ``split``, ``gather`` and ``gather_for_local_use``.

``split`` keeps this rank's slice (no communication either way); the two gathers all-gather the
shards, unpadded when the length divides evenly and padded to the longest shard otherwise.
Outputs are fresh tensors, never views of the input, so in-place ops on them are allowed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..layout import shard_sizes
from ..trace import current_region
from .blocks import empty_blocks, offsets, pack_blocks, unpack_blocks
from .checks import debug_check
from .group import (
    all_gather_single,
    group_rank,
    group_size,
    norm_dim,
    record,
    reduce_scatter_single,
    resolve_length,
)


def split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Replicated → sharded: keep this rank's balanced slice of axis ``dim``.

    ``x`` must be identical on every rank of ``group``. Shape ``[..., L, ...]`` →
    ``[..., shard_sizes(L, N)[rank], ...]``. No communication, forward or backward; the only
    primitive whose backward may itself be differentiated (it is local).
    """
    dim = norm_dim(x, dim, "split")
    if group_size(group) == 1:
        return x
    return _Split.apply(x, dim, group)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        sizes = shard_sizes(x.shape[dim], n)
        ctx.dim, ctx.full, ctx.offset = dim, x.shape[dim], offsets(sizes)[r]
        # a copy even when the slice is contiguous: the output must not be a view of x
        return x.narrow(dim, ctx.offset, sizes[r]).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # local and made of differentiable ops, so double backward is exact
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        out = grad.new_zeros(shape)
        out.narrow(ctx.dim, ctx.offset, grad.shape[ctx.dim]).copy_(grad)
        return out, None, None


def _rows(shape: torch.Size, dim: int, rows: int) -> list[int]:
    """``shape`` with ``rows`` on axis ``dim``."""
    out = list(shape)
    out[dim] = rows
    return out


def all_gather_along(
    x: torch.Tensor,
    dim: int,
    sizes: list[int],
    group: Any,
    region: str | None,
    phase: str = "forward",
) -> torch.Tensor:
    """All-gather shards of axis ``dim`` (sizes per rank) into the full tensor."""
    n, r = group_size(group), group_rank(group)
    error = None
    if x.shape[dim] != sizes[r]:
        error = ValueError(
            f"gather: rank {r} holds {x.shape[dim]} rows of dim {dim} but a length of {sum(sizes)} "
            f"over {n} ranks gives it {sizes[r]}; pass the true global length"
        )
    debug_check(x, group, "gather", (dim, sum(sizes)), (dim,), error)
    longest = max(sizes)
    send = pack_blocks(x, dim, [x.shape[dim]], pad_to=longest)
    shape = _rows(x.shape, dim, sum(sizes))
    recv = empty_blocks(shape, dim, sizes, x, pad_to=longest)
    all_gather_single(recv.view(-1), send, group=group)
    chunk = send.view(_rows(x.shape, dim, longest))
    record(
        "all_gather",
        (n - 1) * chunk.numel() * chunk.element_size(),
        group,
        chunk,
        phase,
        region,
    )
    return unpack_blocks(recv, dim, sizes, shape, pad_to=longest)


def reduce_scatter_along(
    grad: torch.Tensor,
    dim: int,
    sizes: list[int],
    group: Any,
    region: str | None,
    phase: str = "backward",
) -> torch.Tensor:
    """Sum ``grad`` (full on ``dim``) over the group and keep this rank's shard of ``dim``."""
    n, r = group_size(group), group_rank(group)
    longest = max(sizes)
    send = pack_blocks(grad, dim, sizes, pad_to=longest)
    out = torch.empty(_rows(grad.shape, dim, longest), dtype=grad.dtype, device=grad.device)
    reduce_scatter_single(out.view(-1), send, group=group)
    record("reduce_scatter", (n - 1) * out.numel() * out.element_size(), group, out, phase, region)
    return out.narrow(dim, 0, sizes[r])


def gather(x: torch.Tensor, dim: int, group: Any, length: int | None = None) -> torch.Tensor:
    """Sharded → replicated: all-gather axis ``dim`` to its full ``length``.

    Use when what follows is computed *identically* on every rank (a final layer, a loss on
    the whole output, sampling). Backward keeps this rank's slice of the gradient, scaled by
    the group size (the adjoint under that precondition; see :mod:`dspzoo.core.comm`). If
    ``length`` is omitted it is found with one tiny all-reduce.

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``.
    """
    dim = norm_dim(x, dim, "gather")
    if group_size(group) == 1:
        return x
    length = resolve_length(x, dim, group, length)
    return _Gather.apply(x, dim, group, length)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, length: int) -> torch.Tensor:
        n, r = group_size(group), group_rank(group)
        sizes = shard_sizes(length, n)
        ctx.dim, ctx.n, ctx.offset, ctx.size = dim, n, offsets(sizes)[r], sizes[r]
        return all_gather_along(x, dim, sizes, group, None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.narrow(ctx.dim, ctx.offset, ctx.size) * ctx.n, None, None, None


def gather_for_local_use(
    x: torch.Tensor, dim: int, group: Any, length: int | None = None
) -> torch.Tensor:
    """All-gather axis ``dim`` for a use that differs per rank; backward reduce-scatters.

    For full-length operands each rank combines with its *own* shard of something else, e.g.
    keys/values for local queries, a triangle-multiplication operand, a pair bias. The
    gradients of the gathered tensor differ per rank and are summed back to their owners.

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``.
    """
    dim = norm_dim(x, dim, "gather_for_local_use")
    if group_size(group) == 1:
        return x
    length = resolve_length(x, dim, group, length)
    return _GatherForLocalUse.apply(x, dim, group, length, current_region())


class _GatherForLocalUse(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: Any, length: int, region: str
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.region = dim, group, region
        ctx.sizes = shard_sizes(length, group_size(group))
        return all_gather_along(x, dim, ctx.sizes, group, region)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = reduce_scatter_along(grad, ctx.dim, ctx.sizes, ctx.group, ctx.region)
        return grad_x, None, None, None, None

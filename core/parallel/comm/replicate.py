"""Replicated ↔ sharded: ``split``, ``gather`` and ``gather_for_local_use``.

``split`` keeps this rank's slice (no communication either way); the two gathers all-gather the
shards, unpadded when the length divides evenly and padded to the longest shard otherwise.
Outputs are fresh tensors, never views of the input, so in-place ops on them are allowed.
Every forward first agrees on its arguments across the group (:mod:`.agreement`), so a bad
input on one rank raises the same error on every rank.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..layout import shard_sizes
from ..trace import current_region
from .agreement import Signature, agree, guard
from .blocks import empty_blocks, offsets, pack_blocks, unpack_blocks
from .group import (
    all_gather_single,
    group_rank,
    group_size,
    norm_dim,
    record,
    reduce_scatter_single,
)
from .settings import SETTINGS


def split(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Replicated → sharded: keep this rank's balanced slice of axis ``dim``.

    ``x`` must be identical on every rank of ``group``. Shape ``[..., L, ...]`` →
    ``[..., shard_sizes(L, N)[rank], ...]``. No data moves, forward or backward; the only
    primitive whose backward may itself be differentiated (it is local).

    The ranks agree on ``dim``, the shape, dtype and device first (one tiny all-gather of
    their signatures; in debug mode also a checksum of the data), so a rank holding something
    else raises the same error on every rank.
    """
    if group_size(group) == 1:
        return _one_process(x, dim, "split")
    dim = agree_replicated(x, dim, group, "split")
    return _Split.apply(x, dim, group)


def _one_process(x: torch.Tensor, dim: int, primitive: str) -> torch.Tensor:
    """A one-rank group: ``x`` itself, after checking ``dim``."""
    norm_dim(x, dim, primitive)
    return x


def agree_replicated(x: torch.Tensor, dim: int, group: Any, primitive: str) -> int:
    """Agree that every rank holds the same-shaped replicated ``x``; ``dim`` normalised."""
    sig = Signature(primitive)
    try:
        dim = norm_dim(x, dim, primitive)
        sig.arg("dim", dim).tensor("x", x)
        if SETTINGS.debug:
            sig.arg("checksum", checksum(x))
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    agree(sig, group, x.device)
    return dim


def checksum(x: torch.Tensor) -> int:
    """CRC32 of ``x``'s bytes (debug mode: replicated inputs must be identical on every rank)."""
    data = x.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return zlib.crc32(data)


def agree_sharded(
    x: torch.Tensor, dim: int, group: Any, length: int | None, primitive: str
) -> tuple[int, int]:
    """Agree on a gather of ``x``'s shards of ``dim``; returns ``(dim, global length)``.

    Every rank raises the same error if any rank's dim, length, dtype, device or whole-axis
    sizes differ, or its shard is not the balanced one of the length (the sum of the shards
    when ``length`` is ``None``).
    """
    n = group_size(group)
    sig = Signature(primitive)
    try:
        dim = norm_dim(x, dim, primitive)
        if length is not None and int(length) < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        sig.arg("dim", dim).arg("length", length).tensor("x", x, sharded=(dim,))
        sig.local(f"rows of dim {dim}", x.shape[dim])
    except (ValueError, TypeError) as exc:  # shared with every rank by the agreement
        sig.error = exc
    agreed = agree(sig, group, x.device, needs_rows=length is None)
    rows = f"rows of dim {dim}"
    if length is None:
        length = sum(v[0] for v in agreed.local(rows))
        how = f"balanced shards of their sum {length}"
    else:
        length = int(length)
        how = f"a global length of {length} over {n} ranks"
    agreed.check_rows(rows, shard_sizes(length, n), how)
    return dim, length


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
    """All-gather shards of axis ``dim`` (sizes per rank) into the full tensor.

    The building block, without agreement: forward callers agree first (:func:`agree_sharded`);
    backward gradients have the shapes autograd checked.
    """
    n, r = group_size(group), group_rank(group)
    if x.shape[dim] != sizes[r]:
        raise ValueError(
            f"all_gather_along: rank {r} holds {x.shape[dim]} rows of dim {dim} but a length of "
            f"{sum(sizes)} over {n} ranks gives it {sizes[r]} (callers must agree first)"
        )
    longest = max(sizes)
    send = pack_blocks(x, dim, [x.shape[dim]], pad_to=longest)
    shape = _rows(x.shape, dim, sum(sizes))
    recv = empty_blocks(shape, dim, sizes, x, pad_to=longest)
    with guard(f"all_gather ({phase})", group, region, x.device):
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
    with guard(f"reduce_scatter ({phase})", group, region, grad.device):
        reduce_scatter_single(out.view(-1), send, group=group)
    record("reduce_scatter", (n - 1) * out.numel() * out.element_size(), group, out, phase, region)
    return out.narrow(dim, 0, sizes[r])


def gather(x: torch.Tensor, dim: int, group: Any, length: int | None = None) -> torch.Tensor:
    """Sharded → replicated: all-gather axis ``dim`` to its full ``length``.

    Use when what follows is computed *identically* on every rank (a final layer, a loss on
    the whole output, sampling). Backward keeps this rank's slice of the gradient, scaled by
    the group size (the adjoint under that precondition; see :mod:`dspzoo.core.parallel.comm`). If
    ``length`` is omitted it is found with one tiny all-reduce.

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``. Arguments are agreed on first (see
    :func:`agree_sharded`).
    """
    if group_size(group) == 1:
        return _one_process(x, dim, "gather")
    dim, length = agree_sharded(x, dim, group, length, "gather")
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

    Shape ``[..., shard, ...]`` → ``[..., length, ...]``. Arguments are agreed on first (see
    :func:`agree_sharded`).
    """
    if group_size(group) == 1:
        return _one_process(x, dim, "gather_for_local_use")
    dim, length = agree_sharded(x, dim, group, length, "gather_for_local_use")
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
        if SETTINGS.debug:  # autograd already guarantees the gradient's shape and dtype
            agree(Signature("gather_for_local_use").tensor("grad", grad), ctx.group, grad.device)
        grad_x = reduce_scatter_along(grad, ctx.dim, ctx.sizes, ctx.group, ctx.region)
        return grad_x, None, None, None, None

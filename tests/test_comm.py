"""Every primitive against the single-process computation, forward and backward.

Checks use one objective ``J = Σ_r L_r`` equal to the single-process loss ``Σ w·y``: a rank
holding a shard of ``y`` weights it by its slice of ``w``; a rank holding all of a replicated
``y`` contributes ``w·y / N``. Then, by the gradient contract, a sharded input's local gradient
equals its slice of the single-process gradient, and a replicated input's gradients summed over
the group equal the single-process gradient.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from dspzoo.core import comm
from dspzoo.core.layout import shard_offset, shard_sizes
from dspzoo.core.testing import run_distributed

SHAPES = {
    "3d": [(2, 5, 3), (3, 4, 2)],  # lengths not divisible and divisible by 2, 3, 4
    "5d": [(2, 5, 4, 3, 2), (1, 3, 6, 7, 2)],
}


def _slice(t: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    return t.narrow(dim, shard_offset(t.shape[dim], n, r), shard_sizes(t.shape[dim], n)[r])


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_primitives(rank: int, world: int) -> int:
    group = dist.group.WORLD
    checks = 0
    for shapes in SHAPES.values():
        for shape in shapes:
            ndim = len(shape)
            seq_axes = range(1, ndim - 1) if ndim > 3 else range(ndim)
            torch.manual_seed(0)  # identical full tensors on every rank
            full = torch.randn(shape, dtype=torch.float64)
            weight = torch.randn(shape, dtype=torch.float64)

            # single-process reference: y = x, loss = Σ w·x, grad = w
            for dim in seq_axes:
                # split: replicated in, sharded out
                x = full.clone().requires_grad_(True)
                y = comm.split(x, dim, group)
                torch.testing.assert_close(y, _slice(full, dim, world, rank))
                (y * _slice(weight, dim, world, rank)).sum().backward()
                torch.testing.assert_close(_summed(x.grad), weight)

                # gather: sharded in, replicated out (identical use downstream)
                for length in (full.shape[dim], None):
                    x = _slice(full, dim, world, rank).clone().requires_grad_(True)
                    y = comm.gather(x, dim, group, length=length)
                    torch.testing.assert_close(y, full)
                    ((y * weight).sum() / world).backward()
                    torch.testing.assert_close(x.grad, _slice(weight, dim, world, rank))

                # gather for local use: every rank uses the full tensor differently
                x = _slice(full, dim, world, rank).clone().requires_grad_(True)
                y = comm.gather_for_local_use(x, dim, group, length=full.shape[dim])
                torch.testing.assert_close(y, full)
                mine = torch.randn(
                    shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
                )
                (y * mine).sum().backward()
                everyone = _summed(mine)
                torch.testing.assert_close(x.grad, _slice(everyone, dim, world, rank))
                checks += 3

            # switch, every ordered pair of sequence axes, sync and async
            for src, dst in itertools.permutations(seq_axes, 2):
                for use_async in (False, True):
                    x = _slice(full, src, world, rank).clone().requires_grad_(True)
                    if use_async:
                        y = comm.switch_async(x, src, dst, group, src_length=full.shape[src]).wait()
                    else:
                        y = comm.switch(x, src, dst, group, src_length=full.shape[src])
                    torch.testing.assert_close(y, _slice(full, dst, world, rank))
                    (y * _slice(weight, dst, world, rank)).sum().backward()
                    torch.testing.assert_close(x.grad, _slice(weight, src, world, rank))
                    checks += 1
    return checks


@pytest.mark.parametrize("world", [2, 3, 4])
def test_primitives_match_single_process(world: int) -> None:
    counts = run_distributed(_check_primitives, world)
    assert all(c == counts[0] and c > 50 for c in counts)


def _check_switch_bytes(rank: int, world: int) -> tuple[int, int]:
    from dspzoo.core.trace import trace_comm

    x = torch.randn(2, 2, 12, 5, requires_grad=True)  # [B, T_local, S, C]
    with trace_comm() as tracer:
        y = comm.switch(x, 1, 2, dist.group.WORLD, src_length=2 * world)
        y.sum().backward()
    expected = x.numel() * (world - 1) // world * x.element_size()
    assert tracer.count("all_to_all", "forward") == 1
    assert tracer.total_bytes("all_to_all", "forward") == expected
    assert tracer.total_bytes("all_to_all", "backward") == expected
    return tracer.total_bytes(), expected


@pytest.mark.parametrize("world", [2, 4])
def test_switch_bytes_match_formula(world: int) -> None:
    run_distributed(_check_switch_bytes, world)


def _mismatched_switch(rank: int, world: int) -> str:
    comm.set_debug(True)
    # rank 1 has a different channel count: must raise on every rank, not hang
    x = torch.randn(1, 3, 4, 5 + rank)
    try:
        comm.switch(x, 1, 2, dist.group.WORLD, src_length=3 * world)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_shapes_raise_not_hang() -> None:
    messages = run_distributed(_mismatched_switch, 2, timeout=120)
    assert all("disagree" in m for m in messages), messages


def test_single_process_is_identity() -> None:
    x = torch.randn(2, 3, 4)
    assert comm.split(x, 1, None) is x
    assert comm.gather(x, 1, None) is x
    assert comm.switch(x, 1, 2, None) is x
    assert comm.switch_async(x, 1, 2, None).wait() is x


def test_bad_dims_raise() -> None:
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="out of range"):
        comm.split(x, 5, None)

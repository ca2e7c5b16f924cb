"""Every primitive against the single-process computation, forward and backward.

Checks use one objective ``J = Σ_r L_r`` equal to the single-process loss ``Σ w·y``: a rank
holding a shard of ``y`` weights it by its slice of ``w``; a rank holding all of a replicated
``y`` contributes ``w·y / N``. Then, by the gradient contract, a sharded input's local gradient
equals its slice of the single-process gradient, and a replicated input's gradients summed over
the group equal the single-process gradient.

Process start-up dominates the cost, so each world size runs every distributed check in one
``run_distributed`` call (:func:`_check_all`); a failure's traceback names the check.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dspzoo.core import comm
from dspzoo.core.parallel.layout import shard_offset, shard_sizes
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.core.testing import counting_calls, run_distributed

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
                mine = torch.randn(
                    shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
                )
                everyone = _summed(mine)
                for length in (full.shape[dim], None):
                    x = _slice(full, dim, world, rank).clone().requires_grad_(True)
                    y = comm.gather_for_local_use(x, dim, group, length=length)
                    torch.testing.assert_close(y, full)
                    (y * mine).sum().backward()
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


# --------------------------------------------------------------------------------------------
# exact data movement: any dtype, any strides, any lengths (including 0 and 1)

OPS = (
    "split",
    "gather",
    "gather_auto",
    "local",
    "local_auto",
    "switch",
    "switch_auto",
    "switch_async",
)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous (reversed-axes) memory layout."""
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as every second element of a twice-as-wide buffer (non-contiguous)."""
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


def _apply(op: str, x: torch.Tensor, dim: int, dst: int | None, length: int) -> torch.Tensor:
    group = dist.group.WORLD
    if op == "split":
        return comm.split(x, dim, group)
    if op == "gather":
        return comm.gather(x, dim, group, length=length)
    if op == "gather_auto":
        return comm.gather(x, dim, group)
    if op == "local":
        return comm.gather_for_local_use(x, dim, group, length=length)
    if op == "local_auto":
        return comm.gather_for_local_use(x, dim, group)
    assert dst is not None
    if op == "switch":
        return comm.switch(x, dim, dst, group, src_length=length)
    if op == "switch_auto":
        return comm.switch(x, dim, dst, group)
    if op == "switch_async":
        return comm.switch_async(x, dim, dst, group, src_length=length).wait()
    raise AssertionError(op)


def _check_exact(
    rank: int,
    world: int,
    full: torch.Tensor,
    dim: int,
    dst: int | None = None,
    prep: Callable[[torch.Tensor], torch.Tensor] = _same,
    grad_prep: Callable[[torch.Tensor], torch.Tensor] = _same,
    in_place: bool = False,
    ops: tuple[str, ...] = OPS,
) -> int:
    """Each op moves data bitwise like the single-process slice/concat, forward and backward.

    Gradients are small integers so that the reduce-scatter's sums are exact in any dtype.
    ``prep``/``grad_prep`` give the input and the output gradient their memory layout;
    ``in_place`` adds 1 to the output in place before backward.
    """
    n, r = world, rank
    ints = torch.Generator().manual_seed(1)
    common = torch.randint(-8, 9, full.shape, generator=ints).to(full.dtype)  # same on all ranks
    mine = torch.randint(-8, 9, full.shape, generator=torch.Generator().manual_seed(7 + r))
    mine = mine.to(full.dtype)
    everyone = _summed(mine.double()).to(full.dtype)
    checks = 0
    for op in ops:
        if op.startswith("switch") and dst is None:
            continue
        where = (
            f"{op} dtype={full.dtype} shape={tuple(full.shape)} dim={dim} dst={dst} rank={r}/{n}"
        )
        x = prep(full if op == "split" else _slice(full, dim, n, r)).detach().requires_grad_(True)
        y = _apply(op, x, dim, dst, full.shape[dim])
        if op == "split":
            want, grad_out = _slice(full, dim, n, r), _slice(common, dim, n, r)
        elif op.startswith("gather"):
            want, grad_out = full, common
        elif op.startswith("local"):
            want, grad_out = full, mine
        else:
            assert dst is not None
            want, grad_out = _slice(full, dst, n, r), _slice(common, dst, n, r)
        if in_place:
            y.add_(1)
            want = want + 1
        assert y.dtype == full.dtype and torch.equal(y, want), f"forward differs: {where}"
        y.backward(grad_prep(grad_out.clone()))
        if op == "split":
            grad, want_grad = _summed(x.grad.double()), common.double()
        elif op.startswith("gather"):
            grad, want_grad = x.grad, _slice(common, dim, n, r) * n
        elif op.startswith("local"):
            grad, want_grad = x.grad, _slice(everyone, dim, n, r)
        else:
            grad, want_grad = x.grad, _slice(common, dim, n, r)
        assert grad.dtype == want_grad.dtype and torch.equal(grad, want_grad), (
            f"backward differs: {where}"
        )
        checks += 1
    return checks


def _check_low_precision(rank: int, world: int) -> int:
    """bf16 and fp16 move bitwise like the single-process slice and concatenation."""
    checks = 0
    for dtype in (torch.bfloat16, torch.float16):
        full = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(2)).to(dtype)
        checks += _check_exact(rank, world, full, 1, 2)
        checks += _check_exact(rank, world, full, 2, 1)
    return checks


def _check_non_contiguous(rank: int, world: int) -> int:
    """Transposed and strided input views, and non-contiguous output gradients."""
    checks = 0
    full = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(3))
    for prep in (_transposed, _strided):
        checks += _check_exact(rank, world, full, 1, 2, prep=prep, grad_prep=_transposed)
        checks += _check_exact(rank, world, full, 2, 1, prep=prep, grad_prep=_strided)
    # a sharded input that is itself a slice of a larger tensor on the sharded axis
    checks += _check_exact(
        rank, world, full, 2, 1, prep=lambda t: torch.cat([t, t], dim=1)[:, : t.shape[1]]
    )
    return checks


def _check_short_lengths(rank: int, world: int) -> int:
    """Lengths 0 and 1: fewer rows than ranks, so some ranks hold empty shards."""
    checks = 0
    gen = torch.Generator().manual_seed(4)
    for a, b in ((0, 5), (5, 0), (1, 5), (5, 1), (1, 1), (0, 0), (1, 0), (2, 3)):
        full = torch.randn(2, a, b, 3, generator=gen, dtype=torch.float64)
        checks += _check_exact(rank, world, full, 1, 2)
        checks += _check_exact(rank, world, full, 2, 1)
    return checks


def _check_in_place(rank: int, world: int) -> int:
    """Outputs are never views of the inputs: in-place ops work at batch 1 and 2."""
    checks = 0
    gen = torch.Generator().manual_seed(5)
    for batch, (a, b) in itertools.product((1, 2), ((12, 12), (5, 7))):
        full = torch.randn(batch, a, b, 2, generator=gen)
        checks += _check_exact(rank, world, full, 1, 2, in_place=True)
        checks += _check_exact(rank, world, full, 2, 1, in_place=True)
    return checks


def _check_async_out_of_order(rank: int, world: int) -> int:
    """Async switches waited in the reverse order of their start, with a sync one in between."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(6)
    shape = (2, 5, 7, 3)
    x1_full, x2_full, x3_full, w1, w2, w3 = (
        torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(6)
    )
    x1 = _slice(x1_full, 1, world, rank).clone().requires_grad_(True)  # sharded on 1
    x2 = _slice(x2_full, 2, world, rank).clone().requires_grad_(True)  # sharded on 2
    x3 = _slice(x3_full, 1, world, rank).clone().requires_grad_(True)  # sharded on 1
    h1 = comm.switch_async(x1, 1, 2, group, src_length=shape[1])
    h2 = comm.switch_async(x2, 2, 1, group, src_length=shape[2])
    y3 = comm.switch(x3, 1, 2, group, src_length=shape[1])  # sync, while both are in flight
    y2 = h2.wait()  # sharded on 1
    y1 = h1.wait()  # sharded on 2
    assert h1.wait() is y1  # idempotent
    torch.testing.assert_close(y1, _slice(x1_full, 2, world, rank), rtol=0, atol=0)
    torch.testing.assert_close(y2, _slice(x2_full, 1, world, rank), rtol=0, atol=0)
    z = comm.switch(y2, 1, 2, group, src_length=shape[1])  # x2 sharded on 2 again
    loss = (
        (y1 * _slice(w1, 2, world, rank)).sum()
        + (y2 * _slice(w2, 1, world, rank)).sum()
        + (y1 * z * y3 * _slice(w3, 2, world, rank)).sum()
    )
    loss.backward()
    # single process: L = Σ w1·x1 + Σ w2·x2 + Σ w3·x1·x2·x3
    torch.testing.assert_close(x1.grad, _slice(w1 + w3 * x2_full * x3_full, 1, world, rank))
    torch.testing.assert_close(x2.grad, _slice(w2 + w3 * x1_full * x3_full, 2, world, rank))
    torch.testing.assert_close(x3.grad, _slice(w3 * x1_full * x2_full, 1, world, rank))
    return 3


def _check_double_backward(rank: int, world: int) -> int:
    """Differentiating a collective's backward raises on every rank and issues no collective.

    ``split`` has no communication and is differentiable twice (checked against the
    single-process second derivative).
    """
    gen = torch.Generator().manual_seed(8)
    full = torch.randn(2, 6, 5, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, 6, 5, 3, generator=gen, dtype=torch.float64)
    checks = 0
    for op in ("switch", "switch_async", "gather", "local"):
        x = _slice(full, 1, world, rank).clone().requires_grad_(True)
        y = _apply(op, x, 1, 2, full.shape[1])
        w = _slice(weight, 2, world, rank) if op.startswith("switch") else weight / world
        (g,) = torch.autograd.grad((y * y * w).sum(), x, create_graph=True)
        # first order under create_graph: d/dx Σ w·x² = 2·w·x
        torch.testing.assert_close(g, _slice(2 * weight * full, 1, world, rank))
        with trace_comm() as tracer:
            with pytest.raises(RuntimeError, match="differentiate twice"):
                (g * g).sum().backward()
        assert tracer.count() == 0, f"{op}: double backward issued {tracer.records}"
        checks += 1
    # every rank is still in step: nothing stray was issued
    assert int(_summed(torch.ones(1))) == world

    x = full.clone().requires_grad_(True)
    y = comm.split(x, 1, dist.group.WORLD)
    (g,) = torch.autograd.grad((y * y * _slice(weight, 1, world, rank)).sum(), x, create_graph=True)
    (g * g).sum().backward()
    # single process: M = Σ (2·w·x)², dM/dx = 8·w²·x
    torch.testing.assert_close(_summed(x.grad), 8 * weight * weight * full)
    return checks + 1


def _check_switch_bytes(rank: int, world: int) -> int:
    """Traced bytes: the formula, for the sync and the async switch, forward and backward."""
    checks = 0
    for use_async in (False, True):
        x = torch.randn(2, 2, 12, 5, requires_grad=True)  # [B, T_local, S, C]
        with trace_comm() as tracer:
            if use_async:
                y = comm.switch_async(x, 1, 2, dist.group.WORLD, src_length=2 * world).wait()
            else:
                y = comm.switch(x, 1, 2, dist.group.WORLD, src_length=2 * world)
            y.sum().backward()
        expected = x.numel() * (world - 1) // world * x.element_size()
        assert tracer.count("all_to_all", "forward") == 1
        assert tracer.count("all_to_all", "backward") == 1
        assert tracer.total_bytes("all_to_all", "forward") == expected
        assert tracer.total_bytes("all_to_all", "backward") == expected
        assert tracer.total_bytes() == 2 * expected
        checks += 1
    return checks


def _direct_path(min_bytes: int | None) -> contextlib.AbstractContextManager:
    """Switches take the direct path (:mod:`~dspzoo.core.parallel.comm.direct`) for messages
    of at least ``min_bytes`` (``None``: never, the packed all-to-all) inside the block; not
    through shared memory."""
    return comm.SETTINGS.changed(direct_min_bytes=min_bytes, shm_slot_bytes=None)


def _paths_taken() -> dict[str, int]:
    """Switch exchanges started so far by this process, per path."""
    from dspzoo.core.parallel.comm import direct, shm

    return {"shm": shm.exchanges_started(), "direct": direct.exchanges_started()}


def _check_switches_on_one_path(rank: int, world: int, path: str, **settings: Any) -> int:
    """Every switch check with ``settings``; each of their switches (forward and backward:
    hundreds) took ``path`` (``shm``, ``direct`` or ``packed``) and no other."""
    before = _paths_taken()
    comm.SETTINGS._rehearsals.clear()  # calls folded before kept the plans of their path
    with (
        counting_calls(dist, "all_to_all_single") as all_to_alls,
        comm.SETTINGS.changed(**settings),
    ):
        checks = sum(check(rank, world) for check in SWITCH_CHECKS)
    taken = {name: count - before[name] for name, count in _paths_taken().items()}
    taken["packed"] = all_to_alls[0]
    assert taken[path] > 300 and sum(taken.values()) == taken[path], (path, taken)
    return checks


def _check_packed_switch(rank: int, world: int) -> int:
    """The switch checks on the packed all-to-all (gloo between hosts, or shared memory off)."""
    return _check_switches_on_one_path(
        rank, world, "packed", shm_slot_bytes=None, direct_min_bytes=None
    )


def _check_shm_switch(rank: int, world: int) -> int:
    """The switch checks through shared memory in 64-byte chunks (most blocks are streams of
    many chunks through two slots per pair, waited in any order), then what only this path
    has: a dropped switch finished by the next wait, a group where one rank cannot share
    memory (every rank keeps the all-to-all), the setting signed by the agreement."""
    from dspzoo.core.parallel.comm import shm

    checks = _check_switches_on_one_path(rank, world, "shm", shm_slot_bytes=64)
    group = dist.group.WORLD
    full = torch.randn(
        1, 2 * world + 1, 3 * world + 2, 4, generator=torch.Generator().manual_seed(3)
    )
    x, want = _slice(full, 1, world, rank), _slice(full, 2, world, rank)
    comm.SETTINGS._rehearsals.clear()  # no prediction to miss (a miss exchanges too)
    with comm.SETTINGS.changed(shm_slot_bytes=64):
        before = shm.exchanges_started()
        handle = comm.switch_async(x, 1, 2, group, src_length=full.shape[1])
        del handle  # its chunks stay queued; the next wait finishes them first
        assert torch.equal(comm.switch(x, 1, 2, group, src_length=full.shape[1]), want)
        assert shm.exchanges_started() - before == 2
    # rank 1 cannot map shared memory: the new group's switches stay on the all-to-all
    real = shm._can_share
    shm._can_share = (lambda: False) if rank == 1 else real
    try:
        other = dist.new_group(list(range(world)), backend="gloo")
        before = shm.exchanges_started()
        with counting_calls(dist, "all_to_all_single") as all_to_alls:
            y = comm.switch(x, 1, 2, other, src_length=full.shape[1])
        assert torch.equal(y, want) and all_to_alls[0] == 1
        assert shm.exchanges_started() == before and shm.channel_for(other) is None
    finally:
        shm._can_share = real
    # every rank must have the same slot setting (it cuts the chunks)
    with (
        comm.SETTINGS.changed(shm_slot_bytes=None if rank == 1 else 4096),
        pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info,
    ):
        comm.switch(x, 1, 2, group, src_length=full.shape[1])
    assert "DSPZOO_COMM_SHM_SLOT_KIB" in str(info.value)
    # ... compared by every agreement, a gather's too (its all-gather takes the channel)
    with (
        comm.SETTINGS.changed(shm_slot_bytes=None if rank == 1 else 4096),
        pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info,
    ):
        comm.gather(x, 1, group, length=full.shape[1])
    assert "DSPZOO_COMM_SHM_SLOT_KIB" in str(info.value)
    # the all-gather and its reduce-scatter backward in 64-byte chunks: exact, uneven shards
    full = torch.randn(3, 2 * world + 1, 5, dtype=torch.float64)
    torch.distributed.broadcast(full, 0)
    x = _slice(full, 1, world, rank).requires_grad_(True)

    def weight(q: int) -> torch.Tensor:  # a different weight on every rank
        return torch.randn(
            full.shape, generator=torch.Generator().manual_seed(q), dtype=torch.float64
        )

    with comm.SETTINGS.changed(shm_slot_bytes=64):
        before = shm.exchanges_started()
        y = comm.gather_for_local_use(x, 1, group)
        assert torch.equal(y, full)
        (y * weight(rank)).sum().backward()
        assert shm.exchanges_started() - before == 2
    summed = sum(weight(q) for q in range(world))
    torch.testing.assert_close(x.grad, _slice(summed, 1, world, rank), rtol=1e-12, atol=1e-12)
    return checks + 5 + _check_shm_doorbells(rank, world)


def _check_shm_doorbells(rank: int, world: int) -> int:
    """A rank waiting for a late peer dozes on its doorbell and the peer's chunk wakes it
    (``channel.woken``); with the doorbell off, or on a rank that has none, it sleeps its
    dozes out; the switches stay exact either way."""
    import time

    from dspzoo.core.parallel.comm import shm
    from dspzoo.core.parallel.comm.exchange import switch_agreed

    full = torch.randn(1, world + 1, 2 * world + 1, 3, generator=torch.Generator().manual_seed(9))
    x, want, length = _slice(full, 1, world, rank), _slice(full, 2, world, rank), full.shape[1]

    def late_switches(group: Any, late: int, doorbell: bool) -> int:
        """Doorbell wakes on every rank but ``late``, which reaches 5 switches 50 ms late."""
        channel = shm.channel_for(group)
        assert channel is not None
        before = channel.woken
        with comm.SETTINGS.changed(shm_doorbell=doorbell):
            for _ in range(5):
                if rank == late:
                    time.sleep(0.05)
                assert torch.equal(switch_agreed(x, 1, 2, group, src_length=length), want)
        return channel.woken - before

    group = dist.new_group(list(range(world)), backend="gloo")
    woken = late_switches(group, late=world - 1, doorbell=True)
    assert rank == world - 1 or woken >= 1, "the late peer's chunks never rang the doorbell"
    assert late_switches(group, late=world - 1, doorbell=False) == 0
    # rank 0 has no doorbell (its FIFO could not be made): it sleeps its dozes out
    real = shm._make_bell
    shm._make_bell = (lambda path: None) if rank == 0 else real
    try:
        group = dist.new_group(list(range(world)), backend="gloo")
        assert late_switches(group, late=1, doorbell=True) == 0 or rank != 0
        channel = shm.channel_for(group)
        assert (channel.bell is None) == (rank == 0)
        assert rank == 0 or channel.bells[0] is None  # nobody rings a missing doorbell
    finally:
        shm._make_bell = real
    # a doorbell that fails (here: rank 1's wait raises) is closed and the rank sleeps instead;
    # closing a channel's doorbells closes their descriptors once
    group = dist.new_group(list(range(world)), backend="gloo")
    channel = shm.channel_for(group)
    fds = list(channel._bell_fds)
    assert len(fds) == world  # its own and one per peer
    real = shm._readable
    if rank == 1:
        shm._readable = lambda fd, seconds: (_ for _ in ()).throw(ValueError("fd out of range"))
    try:
        late_switches(group, late=0, doorbell=True)
    finally:
        shm._readable = real
    if rank == 1:
        assert channel.bell is None and channel._bell_fds == []
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    assert late_switches(group, late=0, doorbell=True) == 0 or rank != 1
    return 4


def test_readable_waits_on_any_descriptor() -> None:
    """The doorbell's wait: select below FD_SETSIZE, poll above it (select raises there)."""
    from dspzoo.core.parallel.comm.shm import _readable

    read, write = os.pipe()
    high = os.dup2(read, 1500)
    try:
        for fd in (read, high):
            assert not _readable(fd, 0.001)
            os.write(write, b"x")
            assert _readable(fd, 1.0)
            os.read(fd, 1)
    finally:
        for fd in (read, write, high):
            os.close(fd)


def _check_direct_switch(rank: int, world: int) -> int:
    """The switch checks again on the direct path (point-to-point messages from the input
    straight into the result): uneven, empty and explicit shards, every axis pair of 3-d and
    5-d tensors, low precision, strided inputs, async, in place, the traced bytes, the
    agreement's errors and the folded (rehearsed) calls."""
    from dspzoo.core.parallel.comm.direct import exchanges_started

    checks = _check_switches_on_one_path(
        rank, world, "direct", shm_slot_bytes=None, direct_min_bytes=0, direct_max_messages=10**6
    )
    # above the threshold, or with more messages per peer than allowed: the packed all-to-all
    # (unchecked switches: a folded call keeps the plan its group agreed on when it was learnt)
    from dspzoo.core.parallel.comm.exchange import switch_agreed

    full = torch.randn(1, 2 * world, 3 * world, 4, generator=torch.Generator().manual_seed(8))
    x, want = _slice(full, 1, world, rank), _slice(full, 2, world, rank)
    message = 3 * 4 * x.element_size()  # one message: 3 rows of s × 4 channels
    before = exchanges_started()
    with _direct_path(message + 1):  # one byte above the messages' length: packed
        assert torch.equal(switch_agreed(x, 1, 2, dist.group.WORLD, src_length=2 * world), want)
    with comm.SETTINGS.changed(  # 2 messages per peer
        direct_min_bytes=0, direct_max_messages=1, shm_slot_bytes=None
    ):
        assert torch.equal(switch_agreed(x, 1, 2, dist.group.WORLD, src_length=2 * world), want)
    assert exchanges_started() == before
    with _direct_path(message):  # exactly the messages' length: direct
        assert torch.equal(switch_agreed(x, 1, 2, dist.group.WORLD, src_length=2 * world), want)
    assert exchanges_started() == before + 1
    return checks + _check_mixed_paths(rank, world) + _check_dropped_direct_switch(rank, world)


def _check_mixed_paths(rank: int, world: int) -> int:
    """Shared-memory, direct and packed switches in flight together on one group, with a ring
    transfer and a synchronous switch between them, waited in reverse order: all exact."""
    from dspzoo.core.parallel.comm.direct import exchanges_started
    from dspzoo.core.parallel.comm.p2p import RingTransfer

    group, gen = dist.group.WORLD, torch.Generator().manual_seed(11)
    big = torch.randn(1, 3 * world + 1, 4 * world + 2, 8, generator=gen)  # direct: long runs
    small = torch.randn(3, 2 * world + 1, 3, 2, generator=gen)  # packed: short runs
    base = torch.randn(5, generator=gen)
    ring = base + rank
    comm.SETTINGS._rehearsals.clear()  # no prediction to miss (a miss exchanges too)
    with comm.SETTINGS.changed(shm_slot_bytes=64):  # chunks left queued until its wait
        h_shm = comm.switch_async(_slice(big, 1, world, rank), 1, 2, group, big.shape[1])
    with _direct_path(4 * 8 * big.element_size()):  # the shortest run of `big` is 4 rows × 8
        before = exchanges_started()
        h_big = comm.switch_async(_slice(big, 1, world, rank), 1, 2, group, big.shape[1])
        h_small = comm.switch_async(_slice(small, 2, world, rank), 2, 1, group, small.shape[2])
        transfer = RingTransfer([ring], group, [ring.shape])
        y_sync = comm.switch(_slice(big, 2, world, rank), 2, 1, group, src_length=big.shape[2])
        got_ring = transfer.wait()[0]
        y_small, y_big = h_small.wait(), h_big.wait()
        assert exchanges_started() - before == 2  # the two switches of `big`
    assert torch.equal(y_big, _slice(big, 2, world, rank))
    assert torch.equal(y_sync, _slice(big, 1, world, rank))
    assert torch.equal(y_small, _slice(small, 1, world, rank))
    assert torch.equal(got_ring, base + (rank - 1) % world)
    assert torch.equal(h_shm.wait(), _slice(big, 2, world, rank))
    return 1


def _check_dropped_direct_switch(rank: int, world: int) -> int:
    """An async direct switch dropped without its wait (as after an error) leaves the group
    usable: its messages still complete, and the next collective does not time out."""
    group = dist.group.WORLD
    x = torch.randn(1, 2, 3 * world, 4)
    with _direct_path(0):
        handle = comm.switch_async(x, 1, 2, group, src_length=2 * world)
        del handle
        y = comm.switch(x, 1, 2, group, src_length=2 * world)
    assert y.shape == (1, 2 * world, 3, 4)
    return 1


def _check_shm_failures(rank: int, world: int) -> int:
    """Failures through shared memory reach every rank, each on a throwaway group with a short
    timeout: a slot setting changed on one rank before a rehearsed call (the full agreement
    names it, no timeout); a switch one rank skips (a timeout there breaks the channel, and
    the next collective of every rank on that group raises instead of reading a stale chunk);
    a peer whose process is gone (named after about a second, not after the timeout)."""
    import datetime
    import time

    from dspzoo.core.parallel.comm import shm
    from dspzoo.core.parallel.comm.exchange import switch_agreed
    from dspzoo.core.parallel.comm.p2p import RingTransfer

    def fresh(seconds: float) -> Any:
        return dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=seconds))

    full = torch.randn(
        1, 2 * world + 1, 3 * world + 2, 4, generator=torch.Generator().manual_seed(5)
    )
    x, want, length = _slice(full, 1, world, rank), _slice(full, 2, world, rank), full.shape[1]
    group = fresh(20)
    for _ in range(3):  # learnt, rehearsed: the next call is folded
        assert torch.equal(comm.switch(x, 1, 2, group, src_length=length), want)
    start = time.monotonic()
    with (
        comm.SETTINGS.changed(shm_slot_bytes=64 if rank == 1 else comm.SETTINGS.shm_slot_bytes),
        pytest.raises(comm.CollectiveInputError, match="DSPZOO_COMM_SHM_SLOT_KIB"),
    ):
        comm.switch(x, 1, 2, group, src_length=length)
    assert time.monotonic() - start < 10, "a mismatch must not wait for the timeout"
    assert torch.equal(comm.switch(x, 1, 2, group, src_length=length), want)  # still usable
    # a skipped switch: rank 0 times out, and the channel is closed for every rank
    group = fresh(2)
    assert torch.equal(switch_agreed(x, 1, 2, group, src_length=length), want)
    if rank == 0:
        with pytest.raises(comm.CollectiveTimeoutError, match="waited 2 s for a peer"):
            switch_agreed(x, 1, 2, group, src_length=length)
    dist.barrier()  # over gloo: rank 1 goes on only after rank 0 gave up
    with pytest.raises(comm.CollectiveTimeoutError, match="channel is broken"):
        switch_agreed(x, 1, 2, group, src_length=length)
    with pytest.raises(comm.CollectiveTimeoutError, match="channel is broken"):
        RingTransfer([x], group, [x.shape]).wait()
    # a peer that is gone: its pid is checked after a second of waiting
    group = fresh(60)
    assert torch.equal(switch_agreed(x, 1, 2, group, src_length=length), want)
    if rank == 0:
        gone = torch.multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
        gone.start()
        gone.join()
        shm.channel_for(group).pids[1] = gone.pid  # rank 1 "died": its pid is no process now
        start = time.monotonic()
        with pytest.raises(comm.CollectiveTimeoutError, match=r"rank\(s\) \[1\] is gone"):
            switch_agreed(x, 1, 2, group, src_length=length)
        assert time.monotonic() - start < 5
    dist.barrier()
    return 3


def _check_ring_transfers(rank: int, world: int) -> int:
    """``ring_exchange`` and :class:`RingTransfer` through shared memory (64-byte chunks: long
    streams through both slots) and over gloo: every shift, uneven and empty shapes, several
    tensors and dtypes per transfer, two transfers in flight waited in reverse order, and the
    exchange's gradient — each exact, each on the path named."""
    from dspzoo.core.parallel.comm import shm
    from dspzoo.core.parallel.comm.p2p import RingTransfer

    group, checks = dist.group.WORLD, 0
    for slot, path in ((64, "shm"), (None, "gloo")):
        with comm.SETTINGS.changed(shm_slot_bytes=slot):
            before = shm.exchanges_started()
            for shift in range(-1, world + 1):
                src = (rank - shift) % world

                def mine(r: int, shift: int = shift) -> torch.Tensor:
                    gen = torch.Generator().manual_seed(100 * r + shift % world)
                    return torch.randn(2, r + 1, 3, generator=gen, dtype=torch.float64)

                x = mine(rank).requires_grad_(True)
                y = comm.ring_exchange(x, group, shift, recv_shape=mine(src).shape)
                assert torch.equal(y, mine(src)), (path, shift)
                (y * (rank + 1)).sum().backward()  # the gradient comes back from rank + shift
                assert torch.equal(x.grad, torch.full_like(x, (rank + shift) % world + 1))
                checks += 1
            # several tensors (one empty on rank 0, bf16) and two transfers in flight
            sends = [torch.arange(5.0) + rank, torch.zeros(0 if rank == 0 else 4, 2)]
            sends.append(torch.full((3, 7), float(rank), dtype=torch.bfloat16).t())  # strided
            left = (rank - 1) % world
            shapes = [(5,), (0 if left == 0 else 4, 2), (7, 3)]
            first = RingTransfer(sends, group, shapes)
            second = RingTransfer([sends[0] * 2], group, [(5,)], shift=-1)
            back = second.wait()[0]
            got = first.wait()
            assert torch.equal(back, (torch.arange(5.0) + (rank + 1) % world) * 2)
            assert torch.equal(got[0], torch.arange(5.0) + left) and got[1].shape == shapes[1]
            assert torch.equal(got[2], torch.full((7, 3), float(left), dtype=torch.bfloat16))
            taken = shm.exchanges_started() - before
            assert (taken > 0) == (path == "shm"), (path, taken)
            checks += 1
    return checks


def _check_shm_reduce_scatter(rank: int, world: int) -> int:
    """:class:`ShmReduceScatter` with uneven blocks whose float32 sum depends on the order:
    every rank gets exactly ``((b0 + b1) + b2) + …`` of its blocks, and no send is changed."""
    from dspzoo.core.parallel.comm import shm

    channel = shm.transfer_channel(dist.group.WORLD, torch.device("cpu"))
    assert channel is not None
    rows = [r + 1 for r in range(world)]  # uneven: rank q's result has q + 1 rows

    def block(src: int, dst: int) -> torch.Tensor:  # what rank src sends rank dst
        # 1, 1e8, -1e8, …: in float32 (1 + 1e8) - 1e8 = 0 but (-1e8 + 1e8) + 1 = 1, so from
        # three ranks on any other order of the additions gives another sum
        fill = {0: 1.0, 1: 1e8, 2: -1e8}.get(src, 0.25 * src)
        return torch.full((rows[dst], 3), fill, dtype=torch.float32) + 0.001 * dst

    sends = [block(rank, q) for q in range(world)]
    kept = [t.clone() for t in sends]
    exchange = shm.ShmReduceScatter(channel, sends, torch.empty(rows[rank], 3))
    exchange.wait()
    out = exchange.total()
    expected = block(0, rank).clone()
    for src in range(1, world):
        expected += block(src, rank)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(sends, kept))
    return 1


def _check_workspace(rank: int, world: int) -> int:
    """The CPU send workspace is bounded by its limit and released on request."""
    with _direct_path(None):  # the packed path is the one with a send buffer
        return _workspace_bounded(rank, world)


def _workspace_bounded(rank: int, world: int) -> int:
    group = dist.group.WORLD
    full = torch.randn(2, 2 * world, 12, 5, generator=torch.Generator().manual_seed(9))
    x = _slice(full, 1, world, rank)
    comm.release_workspace()
    y = comm.switch(x, 1, 2, group)  # leading batch axis: the send buffer needs a copy
    assert torch.equal(y, _slice(full, 2, world, rank))
    assert comm.release_workspace() > 0
    assert comm.release_workspace() == 0
    previous = comm.set_workspace_limit(32)  # bytes: every send here is larger
    try:
        y = comm.switch(x, 1, 2, group)
        assert torch.equal(y, _slice(full, 2, world, rank))
        assert comm.release_workspace() == 0
    finally:
        comm.set_workspace_limit(previous)
    return 1


def _check_recycled_results(rank: int, world: int) -> int:
    """Switch results reuse the group's free storages, never one a tensor still holds.

    Held results (by the caller, or saved by autograd for a backward) stay intact through later
    switches; a dropped one's storage comes back; results are not views and may be modified
    in place.
    """
    with comm.SETTINGS.changed(recycle_results=True):  # off by default
        _recycled_results_stay_intact(dist.group.WORLD, rank, world)
    return 1


def _recycled_results_stay_intact(group: Any, rank: int, world: int) -> None:
    full = torch.randn(2, 2 * world, 12, 5, generator=torch.Generator().manual_seed(4))
    x = _slice(full, 1, world, rank)
    want = _slice(full, 2, world, rank)
    held = [comm.switch(x, 1, 2, group) for _ in range(4)]  # more than a shape keeps
    assert len({h.data_ptr() for h in held}) == 4
    for h in held:
        assert torch.equal(h, want) and h._base is None
    held[0].add_(1.0)  # in place on a result
    assert torch.equal(held[1], want)
    del held
    y = comm.switch(x, 1, 2, group)
    kept = {
        s.data_ptr() for stores in comm.SETTINGS.workspace(group).outputs.values() for s in stores
    }
    assert y.data_ptr() in kept  # a storage the group kept, now free again: no fresh one
    del y
    y = comm.switch(x, 1, 2, group)
    assert y.data_ptr() in kept and torch.equal(y, want)
    # a result saved by autograd is not handed out again before its backward
    xg = x.clone().requires_grad_(True)
    loss = comm.switch(xg, 1, 2, group).sin()
    saved = [comm.switch(x, 1, 2, group) for _ in range(3)]
    assert all(torch.equal(s, want) for s in saved)
    loss.sum().backward()
    assert torch.allclose(xg.grad, _slice(full, 1, world, rank).cos())


def _check_mismatched_switch(rank: int, world: int) -> int:
    """Rank 1 has a different channel count or dtype: every rank raises the same error (no hang).

    Debug mode off: the agreement of every primitive runs anyway.
    """
    assert not comm.SETTINGS.debug
    x = torch.randn(1, 3, 4, 5 + (rank == 1))
    with pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info:
        comm.switch(x, 1, 2, dist.group.WORLD, src_length=3 * world)
    assert "x.shape differs" in str(info.value) and "(1, shard, 4, 6)" in str(info.value)
    # a dtype mismatch names the dtypes of every rank
    x = torch.randn(1, 3, 4, 5, dtype=torch.float16 if rank == 1 else torch.float32)
    with pytest.raises(comm.CollectiveInputError, match="rank 1: float16") as info:
        comm.switch(x, 1, 2, dist.group.WORLD, src_length=3 * world)
    assert "float32" in str(info.value)
    # the direct path's settings decide how a switch travels: every rank must have the same
    with (
        _direct_path(None if rank == 1 else 0),
        pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info,
    ):
        comm.switch(torch.randn(1, 3, 4, 5), 1, 2, dist.group.WORLD, src_length=3 * world)
    assert "DSPZOO_COMM_DIRECT_MIN_KIB" in str(info.value)
    # ... and so must an attention method's entry, whose inner switches skip their agreement
    from dspzoo.core.parallel.methods.ulysses import ulysses_attention

    q = torch.randn(1, 2, 2 * world, 4)  # [B, tokens of this rank, heads, head dim]
    with (
        _direct_path(None if rank == 1 else 0),
        pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info,
    ):
        ulysses_attention(q, q, q, group=dist.group.WORLD, seq_lengths=[2] * world)
    assert "DSPZOO_COMM_DIRECT_MIN_KIB" in str(info.value)
    return 1


def _check_explicit_sizes(rank: int, world: int) -> int:
    """A switch between arbitrary contiguous partitions (``src_sizes`` / ``dst_sizes``)."""
    group = dist.group.WORLD
    src_sizes = [0, 3, *([1] * (world - 2))]  # rank 0 empty, rank 1 three rows
    dst_sizes = [*([1] * (world - 1)), 2]
    length_src, length_dst = sum(src_sizes), sum(dst_sizes)
    torch.manual_seed(0)
    full = torch.randn(2, length_src, length_dst, 3, dtype=torch.float64)
    weight = torch.randn(full.shape, dtype=torch.float64)
    start = sum(src_sizes[:rank])
    x = full[:, start : start + src_sizes[rank]].clone().requires_grad_(True)
    y = comm.switch(x, 1, 2, group, src_sizes=src_sizes, dst_sizes=dst_sizes)
    d0 = sum(dst_sizes[:rank])
    torch.testing.assert_close(y, full[:, :, d0 : d0 + dst_sizes[rank]])
    (y * weight[:, :, d0 : d0 + dst_sizes[rank]]).sum().backward()
    torch.testing.assert_close(x.grad, weight[:, start : start + src_sizes[rank]])
    with pytest.raises(ValueError, match="src_sizes"):
        comm.switch(x.detach(), 1, 2, group, src_sizes=[1] * (world + 1))
    return 1


def _check_rehearsed_switch(rank: int, world: int) -> int:
    """Repeated switches run folded (status words in the all-to-all, no separate agreement).

    Every layout — the result received in place or joined by a copy, uneven and empty shards,
    bf16, three and more ranks (headers between the blocks) — equals the single-process slice,
    forward and backward, on the first (agreed in full) and the repeated (folded) calls, and the
    folded result may be modified in place.
    """
    from dspzoo.core.parallel.comm.settings import SETTINGS

    group = dist.group.WORLD
    rehearsal = SETTINGS.rehearsal(group)
    hits = rehearsal.hits
    checks = 0
    cases = [
        ((1, 5, 7, 3), torch.float64),
        ((2, 3, 4), torch.float64),
        ((1, 9, 2, 4), torch.bfloat16),
    ]
    for shape, dtype in cases:
        torch.manual_seed(0)
        full = torch.randn(shape).to(dtype)
        weight = torch.randn(shape).to(dtype)
        for src, dst in itertools.permutations(range(len(shape)), 2):
            x = _slice(full, src, world, rank)
            length = full.shape[src] if dst else None  # without a length: the sum of shards
            traced = []
            for _ in range(3):  # the group learns the call; the later ones are folded
                xr = x.clone().requires_grad_(True)
                with trace_comm() as tracer:
                    y = comm.switch(xr, src, dst, group, src_length=length)
                traced.append([(c.op, c.phase, c.bytes_sent) for c in tracer.records])
                torch.testing.assert_close(y, _slice(full, dst, world, rank), rtol=0, atol=0)
                (y * _slice(weight, dst, world, rank)).sum().backward()
                torch.testing.assert_close(xr.grad, _slice(weight, src, world, rank))
                y.detach().add_(1)  # in place on the result is allowed
                checks += 1
            assert traced[0] == traced[1] == traced[2], traced  # the fold is not traced
    assert rehearsal.hits - hits >= len(cases), "no switch ran folded"
    return checks


# every check of the switch's data movement and errors; run again on every path
SWITCH_CHECKS: tuple[Callable[[int, int], int], ...] = (
    _check_explicit_sizes,
    _check_primitives,
    _check_switch_bytes,
    _check_low_precision,
    _check_non_contiguous,
    _check_short_lengths,
    _check_in_place,
    _check_async_out_of_order,
    _check_double_backward,
    _check_recycled_results,
    _check_mismatched_switch,
    _check_rehearsed_switch,
)
CHECKS = (
    *SWITCH_CHECKS,  # the default path: through shared memory, on this one host
    _check_packed_switch,
    _check_workspace,
    _check_direct_switch,
    _check_shm_switch,
    _check_shm_failures,
    _check_ring_transfers,
    _check_shm_reduce_scatter,
)


def _check_all(rank: int, world: int) -> dict[str, int]:
    return {check.__name__: check(rank, world) for check in CHECKS}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_primitives_match_single_process(world: int) -> None:
    counts = run_distributed(_check_all, world)
    assert all(c == counts[0] for c in counts), counts
    assert counts[0]["_check_primitives"] > 50
    assert all(v > 0 for v in counts[0].values()), counts[0]


def test_single_process_is_identity() -> None:
    x = torch.randn(2, 3, 4)
    assert comm.split(x, 1, None) is x
    assert comm.gather(x, 1, None) is x
    assert comm.gather_for_local_use(x, 1, None) is x
    assert comm.switch(x, 1, 2, None) is x
    assert comm.switch_async(x, 1, 2, None).wait() is x


def test_bad_dims_raise() -> None:
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="out of range"):
        comm.split(x, 5, None)


@pytest.mark.parametrize("sizes", [[3, 3, 2, 2], [2, 2, 2], [1, 0, 0], [0, 0], [4]])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_pack_unpack_round_trip(sizes: list[int], axis: int) -> None:
    """pack_blocks → unpack_blocks is the identity, padded or not, for any strides."""
    from dspzoo.core.parallel.comm.blocks import empty_blocks, pack_blocks, unpack_blocks

    shape = [2, 3, 4]
    shape[axis] = sum(sizes)
    x = _transposed(torch.randn(shape))
    for pad_to in (None, max(sizes) + 1):
        packed = pack_blocks(x, axis, sizes, pad_to=pad_to, reuse=True)
        buf = empty_blocks(shape, axis, sizes, x, pad_to=pad_to)
        buf.view(-1).copy_(packed)
        y = unpack_blocks(buf, axis, sizes, shape, pad_to=pad_to)
        assert torch.equal(y, x) and y._base is None
    comm.release_workspace()


def test_recycled_output_storage() -> None:
    """Workspace.output hands out a storage again only once no tensor holds it."""
    from dspzoo.core.parallel.comm.settings import Workspace

    ws, like = Workspace(), torch.empty(0)
    a = ws.output([3, 4], like, 2**20)
    b = ws.output([3, 4], like, 2**20)
    assert a is not None and b is not None and a.data_ptr() != b.data_ptr()
    assert a.is_contiguous() and a._base is None and list(a.shape) == [3, 4]
    assert ws.output([3, 4], like, 2**20) is None  # both held, at most two kept per size
    ptr = a.data_ptr()
    view = a[1:]
    del a
    assert ws.output([12], like, 2**20) is None  # the view still holds a's storage
    del view
    c = ws.output([12], like, 2**20)  # same numel, another shape
    assert c is not None and c.data_ptr() == ptr
    assert ws.output([3, 4], like, 10) is None  # above the limit: allocate fresh
    del b, c
    ws.shrink(0)
    assert ws.output_nbytes() == 0


def test_workspace_limit() -> None:
    x = _transposed(torch.randn(4, 6, 5))
    comm.release_workspace()
    previous = comm.set_workspace_limit(0)
    try:
        from dspzoo.core.parallel.comm.blocks import pack_blocks

        pack_blocks(x, 1, [3, 3], reuse=True)
        assert comm.release_workspace() == 0
        comm.set_workspace_limit(2**20)
        pack_blocks(x, 1, [3, 3], reuse=True)
        assert comm.release_workspace() == x.numel() * x.element_size()
        with pytest.raises(ValueError, match=">= 0"):
            comm.set_workspace_limit(-1)
    finally:
        comm.set_workspace_limit(previous)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc"])
def test_a_bad_direct_threshold_warns_and_keeps_the_default(monkeypatch, value: str) -> None:
    """``DSPZOO_COMM_DIRECT_MIN_KIB`` is read at import: a bad value must not break it."""
    from dspzoo.core.parallel.comm.settings import DIRECT_MIN_KIB, _env_bytes

    monkeypatch.setenv("DSPZOO_COMM_DIRECT_MIN_KIB", value)
    with pytest.warns(UserWarning, match="DSPZOO_COMM_DIRECT_MIN_KIB"):
        assert _env_bytes("DSPZOO_COMM_DIRECT_MIN_KIB", DIRECT_MIN_KIB) == DIRECT_MIN_KIB * 1024
    monkeypatch.setenv("DSPZOO_COMM_DIRECT_MIN_KIB", "off")
    assert _env_bytes("DSPZOO_COMM_DIRECT_MIN_KIB", DIRECT_MIN_KIB) is None


@pytest.mark.parametrize("value", ["nan", "-1", "abc", "off"])
def test_a_bad_workspace_limit_warns_and_keeps_the_default(monkeypatch, value: str) -> None:
    """``DSPZOO_COMM_WORKSPACE_MIB`` (read at import) warns on a bad value, 'off' included
    (a limit has no 'off'), and keeps 256 MiB; a good one is read in MiB."""
    from dspzoo.core.parallel.comm.settings import CommSettings

    monkeypatch.setenv("DSPZOO_COMM_WORKSPACE_MIB", value)
    with pytest.warns(UserWarning, match="DSPZOO_COMM_WORKSPACE_MIB.*MiB"):
        assert CommSettings().workspace_limit == 256 * 2**20
    monkeypatch.setenv("DSPZOO_COMM_WORKSPACE_MIB", "1.5")
    assert CommSettings().workspace_limit == 3 * 2**19


@pytest.mark.parametrize(("value", "on"), [("", True), ("1", True), ("0", False), ("off", False)])
def test_the_doorbell_setting(monkeypatch, value: str, on: bool) -> None:
    from dspzoo.core.parallel.comm.settings import CommSettings

    monkeypatch.setenv("DSPZOO_COMM_SHM_DOORBELL", value)
    assert CommSettings().shm_doorbell is on

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

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from dspzoo.core import comm
from dspzoo.core.parallel.layout import shard_offset, shard_sizes
from dspzoo.core.parallel.trace import trace_comm
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


def _check_ring_transfers(rank: int, world: int) -> int:
    """``ring_exchange`` and :class:`RingTransfer`: every shift, uneven and empty shapes, several
    tensors and dtypes per transfer, two transfers in flight waited in reverse order, and the
    exchange's gradient — each exact."""
    from dspzoo.core.parallel.comm.p2p import RingTransfer

    group, checks = dist.group.WORLD, 0
    for shift in range(-1, world + 1):
        src = (rank - shift) % world

        def mine(r: int, shift: int = shift) -> torch.Tensor:
            gen = torch.Generator().manual_seed(100 * r + shift % world)
            return torch.randn(2, r + 1, 3, generator=gen, dtype=torch.float64)

        x = mine(rank).requires_grad_(True)
        y = comm.ring_exchange(x, group, shift, recv_shape=mine(src).shape)
        assert torch.equal(y, mine(src)), shift
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
    checks += 1
    return checks


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
    # ... and so must an attention method's entry, whose inner switches skip their agreement
    from dspzoo.core.parallel.methods.ulysses import ulysses_attention

    q = torch.randn(1, 2, 2 * world + (rank == 1), 4)  # [B, tokens of this rank, heads, head dim]
    with pytest.raises(comm.CollectiveInputError, match="rank 1 disagrees") as info:
        ulysses_attention(q, q, q, group=dist.group.WORLD, seq_lengths=[2] * world)
    # a trusted call (the runtime's, after its entry agreement) exchanges nothing: a wrong
    # shard is found by the rank that holds it, alone
    x = torch.randn(1, 3 + (rank == 1), 4, 5)
    with trace_comm() as tracer, comm.trusted_calls(dist.group.WORLD):
        if rank == 1:
            with pytest.raises(ValueError, match="rank 1 holds 4 rows"):
                comm.switch(x, 1, 2, dist.group.WORLD, src_length=3 * world)
    assert tracer.control_count() == 0
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
    _check_mismatched_switch,
)
CHECKS = (
    *SWITCH_CHECKS,
    _check_ring_transfers,
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
        packed = pack_blocks(x, axis, sizes, pad_to=pad_to)
        buf = empty_blocks(shape, axis, sizes, x, pad_to=pad_to)
        buf.view(-1).copy_(packed)
        y = unpack_blocks(buf, axis, sizes, shape, pad_to=pad_to)
        assert torch.equal(y, x) and y._base is None

"""Keyed randomness on sharded activations: one-process values under any sharding and SP size."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dspzoo.core import SeqParallel, SeqSpec, SPMesh
from dspzoo.core.parallel.layout import shard_offset, shard_sizes
from dspzoo.core.parallel.rng import mix_key, splitmix64
from dspzoo.core.parallel.sharded_rng import (
    dropout,
    keep_mask,
    random_bits,
    shard_block,
    sharded_dropout,
    sharded_uniform,
    uniform,
)
from dspzoo.core.testing import run_distributed

GOLDEN, MASK64 = 0x9E3779B97F4A7C15, (1 << 64) - 1


def _reference_bits(key: int, coords: tuple[int, ...]) -> int:
    """The documented hash in Python integers: fold the coordinates with SplitMix64."""
    h = splitmix64(key & MASK64)
    for c in coords:
        h = splitmix64((h + c * GOLDEN) & MASK64)
    return h


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double().flatten(), b.double().flatten()]))[0, 1])


# -- one process ---------------------------------------------------------------------------


def test_torch_hash_matches_python_reference() -> None:
    """int64 wrap-around and the emulated logical shifts give the exact unsigned arithmetic."""
    for key in (0, 1, mix_key(7, "dropout"), (1 << 64) - 1, -5):
        offsets = (2**40, 3, 2**31 - 2)
        bits = random_bits(key, (2, 3, 2), offsets=offsets)
        for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(2)):
            coords = tuple(o + int(i) for o, i in zip(offsets, idx, strict=True))
            assert int(bits[tuple(idx)]) & MASK64 == _reference_bits(key, coords)
    assert random_bits(3, ()).shape == ()  # a scalar is the hash of the key alone
    assert int(random_bits(3, ())) & MASK64 == splitmix64(3)


def test_any_block_equals_the_slice_of_the_whole() -> None:
    key = mix_key(0, 1, "x")
    full = uniform(key, (5, 7, 3), dtype=torch.float64)
    block = uniform(key, (2, 4, 3), offsets=(3, 1, 0), global_shape=(5, 7, 3), dtype=torch.float64)
    assert torch.equal(block, full[3:5, 1:5])
    # values depend on coordinates only, not on the global shape
    assert torch.equal(uniform(key, (6, 9, 4), dtype=torch.float64)[:5, :7, :3], full)
    with pytest.raises(ValueError, match="does not fit"):
        uniform(key, (3, 4, 3), offsets=(3, 0, 0), global_shape=(5, 7, 3))
    with pytest.raises(ValueError, match="one non-negative offset per axis"):
        uniform(key, (3, 4), offsets=(0,))


def test_statistics_are_sane() -> None:
    """Mean, lag-1 correlation along both axes and between keys, histogram, keep rate."""
    u = uniform(mix_key(1, "stats"), (320, 320), dtype=torch.float64)  # ~10**5 values
    assert abs(float(u.mean()) - 0.5) < 0.005  # σ ≈ 0.0009
    assert abs(_corr(u[:, :-1], u[:, 1:])) < 0.02  # σ ≈ 0.003
    assert abs(_corr(u[:-1], u[1:])) < 0.02
    assert abs(_corr(u, u.T)) < 0.02  # no symmetry between coordinates
    v = uniform(mix_key(1, "stats") + 1, (320, 320), dtype=torch.float64)
    assert abs(_corr(u, v)) < 0.02  # adjacent keys are unrelated
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 45  # 15 degrees of freedom: p ≈ 1e-4
    keep = keep_mask(5, 0.3, (320, 320))
    assert abs(float(keep.double().mean()) - 0.7) < 0.01


def test_keep_mask_is_the_53_bit_uniform_compared_with_p() -> None:
    u = uniform(5, (4096,), dtype=torch.float64)
    for p in (0.0, 1e-17, 0.1, 0.5, 0.999999, 1 - 2**-53, 1.0):
        assert torch.equal(keep_mask(5, p, (4096,)), u >= p), p


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_uniform_dtypes_are_exact_and_below_one(dtype: torch.dtype) -> None:
    u = uniform(11, (4096,), dtype=dtype)
    assert u.dtype == dtype and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # the top bits of the same hash: a coarser dtype is the finer value rounded down
    fine = uniform(11, (4096,), dtype=torch.float64)
    assert torch.all(u.double() <= fine) and torch.all(
        fine - u.double() < 2 * torch.finfo(dtype).eps
    )


def test_dropout_semantics_and_autograd() -> None:
    gen = torch.Generator().manual_seed(0)
    state = torch.get_rng_state()
    x = torch.randn(2, 5, 7, 3, dtype=torch.float64, generator=gen).requires_grad_()
    y = dropout(x, 0.25, key=42)
    keep = keep_mask(42, 0.25, x.shape)
    assert torch.equal(y, torch.where(keep, x * (1 / 0.75), torch.zeros(())))
    g = torch.randn(x.shape, dtype=x.dtype, generator=gen)
    (y * g).sum().backward()
    assert torch.equal(x.grad, keep.double() * (1 / 0.75) * g)
    # the mask is the same whatever the activation's dtype
    assert torch.equal(dropout(x.float(), 0.25, key=42) != 0, keep)
    assert not torch.equal(dropout(x, 0.25, key=43), y)  # another key, another mask
    assert dropout(x, 0.0, key=1) is x and dropout(x, 0.5, key=1, training=False) is x
    assert torch.equal(dropout(x, 1.0, key=1), torch.zeros_like(x))
    for bad in (-0.1, 1.5, True, float("nan"), "0.1"):
        with pytest.raises(ValueError, match=r"dropout probability must be a number in \[0, 1\]"):
            dropout(x, bad, key=1)  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched


def test_shared_axes_broadcast_one_mask_value() -> None:
    x = torch.ones(2, 5, 7, 3)
    y = dropout(x, 0.5, key=9, shared_axes=(1,))  # one value for every position along axis 1
    assert torch.equal(y, y[:, :1].expand_as(y))
    assert not torch.equal(y, y[:, :, :1].expand_as(y))
    assert torch.equal(y[:, :1], 2 * keep_mask(9, 0.5, (2, 1, 7, 3)).float())
    y2 = dropout(x, 0.5, key=9, shared_axes=(-3, 2))
    assert torch.equal(y2, y2[:, :1, :1].expand_as(y2))


def test_shard_block_and_batch_offset() -> None:
    spec = SeqSpec(("t", "s"), (5, 7), first_axis=1, sharded="t")
    block = shard_block(spec, (2, 1, 7, 3), rank=2, world=4, shared=("s",), batch_offset=4)
    assert block.shape == (2, 1, 1, 3) and block.offsets == (4, 3, 0, 0)
    big = torch.randn(6, 5, 7, 3)
    ref = dropout(big, 0.5, key=3)
    local = sharded_dropout(big[4:], 0.5, 3, spec.with_sharded(None), 0, 1, batch_offset=4)
    assert torch.equal(local, ref[4:])
    with pytest.raises(ValueError, match="does not match its sequence spec"):
        shard_block(spec, (2, 5, 7, 3), rank=2, world=4)
    with pytest.raises(ValueError, match="batch_offset"):
        shard_block(SeqSpec(("t",), (5,), first_axis=0), (5, 3), 0, 1, batch_offset=1)
    with pytest.raises(ValueError, match="unknown sequence dim 'r'"):
        shard_block(spec, (2, 2, 7, 3), rank=0, world=4, shared=("r",))


# -- SP groups of 2, 3 and 4 in one world of 4 ----------------------------------------------------

NAMES, LENGTHS, B, C = ("s", "r"), (5, 7), 2, 3  # an MSA [B, S, R, C], both dims uneven
SHARED = ((), ("s",), ("r",), ("s", "r"))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _check_group(sp: SeqParallel, x_full: torch.Tensor) -> None:
    rank, n = sp.rank, sp.size
    spec = SeqSpec(NAMES, LENGTHS, first_axis=1)
    for dim in NAMES:
        axis, off = spec.axis(dim), shard_offset(spec.length(dim), n, rank)
        size = shard_sizes(spec.length(dim), n)[rank]
        for shared in SHARED:
            key = mix_key(0, n, dim, *shared, "dropout")
            shared_axes = tuple(spec.axis(s) for s in shared)
            # uniform draws: this rank's block of the one-process tensor
            full_shape = [1 if a in shared_axes else s for a, s in enumerate(x_full.shape)]
            ref_u = uniform(key, full_shape, dtype=torch.float64)
            local_shape = list(x_full.shape)
            local_shape[axis] = size
            got_u = sharded_uniform(
                key, spec.with_sharded(dim), local_shape, rank, n, shared, dtype=torch.float64
            )
            want_u = ref_u if dim in shared else ref_u.narrow(axis, off, size)
            assert torch.equal(got_u, want_u), (n, dim, shared)

            # dropout forward and backward through SeqParallel
            x_ref = x_full.clone().requires_grad_()
            y_ref = dropout(x_ref, 0.5, key, shared_axes=shared_axes)
            g = torch.randn(
                x_full.shape, generator=torch.Generator().manual_seed(7), dtype=x_full.dtype
            )
            (y_ref * g).sum().backward()
            act = sp.shard(x_full, spec, dim)
            x_loc = act.tensor.detach().clone().requires_grad_()
            out = sp.dropout(act.with_tensor(x_loc), 0.5, key, shared_along=shared)
            assert out.spec == act.spec
            assert torch.equal(out.tensor, y_ref.detach().narrow(axis, off, size)), (n, dim, shared)
            (out.tensor * g.narrow(axis, off, size)).sum().backward()
            assert torch.equal(x_loc.grad, x_ref.grad.narrow(axis, off, size)), (n, dim, shared)
            assert torch.equal(sp.exit(out), y_ref.detach())  # reassembled over the group

    # switching the sharded dim between two dropout calls
    k1, k2 = mix_key(1, "attn_dropout"), mix_key(1, "mlp_dropout")
    ref = dropout(dropout(x_full, 0.3, k1, shared_axes=(1,)), 0.3, k2, shared_axes=(2,))
    act = sp.dropout(sp.shard(x_full, spec, "r"), 0.3, k1, shared_along=("s",))
    act = sp.dropout(sp.switch(act, "s"), 0.3, k2, shared_along=("r",))
    assert torch.equal(sp.exit(act), ref)
    # eval mode / p = 0 hand back the same activation
    assert sp.dropout(act, 0.3, k1, training=False) is act and sp.dropout(act, 0.0, k1) is act


def _naive(sp: SeqParallel, x_full: torch.Tensor) -> tuple[bool, str, str]:
    """torch dropout on shards: neither the one-process mask nor in step across ranks."""
    spec = SeqSpec(NAMES, LENGTHS, first_axis=1)
    torch.manual_seed(0)
    ref = F.dropout(x_full, 0.5)
    torch.manual_seed(0)
    act = sp.shard(x_full, spec, "r")  # R = 7 over 4 ranks: shards of 2, 2, 2, 1
    local = F.dropout(torch.ones_like(act.tensor), 0.5)
    y = sp.exit(act.with_tensor(act.tensor * local))
    return torch.equal(y, ref), _digest(torch.get_rng_state()), _digest(local != 0)


def _sp_worker(rank: int, world: int) -> dict:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    x_full = torch.randn(B, *LENGTHS, C, generator=torch.Generator().manual_seed(3))
    x_full = x_full.double()
    checked = []
    for n, group in groups.items():
        if rank >= n:
            continue
        mesh = SPMesh(world, rank, dp_size=1, sp_size=n, dp_rank=0, sp_rank=rank, sp_group=group)
        _check_group(SeqParallel(mesh), x_full)
        checked.append(n)
    rng_after = torch.get_rng_state()
    unchanged = torch.equal(rng_after, state)
    naive = _naive(SeqParallel(SPMesh(world, rank, 1, world, 0, rank, groups[4])), x_full)
    return {
        "checked": checked,
        "unchanged": unchanged,
        "rng": _digest(rng_after),
        "naive": naive,
    }


def test_sharded_draws_equal_one_process_at_sp_2_3_4() -> None:
    results = run_distributed(_sp_worker, 4, timeout=120)
    assert [r["checked"] for r in results] == [[2, 3, 4], [2, 3, 4], [3, 4], [4]]
    assert all(r["unchanged"] for r in results)
    assert len({r["rng"] for r in results}) == 1  # the global RNG is identical on every rank
    # what this replaces: torch dropout on shards misses the one-process mask, leaves the
    # ranks' generators out of step (uneven shards) and repeats one mask on equal shards
    match, states, masks = zip(*(r["naive"] for r in results), strict=True)
    assert not any(match)
    assert states[0] != states[3]
    assert masks[0] == masks[1]

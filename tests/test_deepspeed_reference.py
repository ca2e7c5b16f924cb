"""Reference check: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) vs ours.

Optional: skipped unless ``deepspeed`` is importable (it is not a dependency; the ``peers``
extra names it). On gloo, after ``deepspeed.init_distributed(dist_backend="gloo")``:

* divisible shapes at SP 2, 3 and 4 (MHA and GQA with ``Hkv % N == 0``, causal or not):
  DeepSpeed's outputs and dq, dk, dv equal :func:`ulysses_attention`'s (fp64, tight);
* heads not divisible by N (DeepSpeed reads the SP rank from ``deepspeed.utils.groups.mpu``,
  set here to a small adapter): equal as well;
* fewer heads than ranks (3 heads at SP 4): DeepSpeed asserts "at least the sequence parallel
  size"; ours runs with idle ranks (checked in :mod:`tests.test_ulysses_lss`);
* a sequence length N does not divide (balanced shards 4 + 3): DeepSpeed's equal-split
  all-to-all does not apply — its gloo exchange aborts a worker ("Received data size doesn't
  match expected size") — while ours is exact on the same shards
  (:mod:`tests.test_ulysses_lss` checks it against single-process attention).
"""

from __future__ import annotations

import datetime
import importlib.util

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.layers.attention import attend
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.methods import ulysses_attention
from dspzoo.core.testing import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)

B, D = 2, 4


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_ops_built():
    """Build (or load from cache) the CPU shared-memory op DeepSpeed's init loads, once, here:
    its first JIT build can take a minute, which the workers' deadlines should not include."""
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


class _LocalAttention:
    """The local attention DeepSpeed calls on ``[B, L, H/N, D]`` tensors (GQA expanded here)."""

    def __init__(self, causal: bool) -> None:
        self.causal = causal

    def __call__(self, q, k, v, *args, **kwargs):
        g = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        return attend(q, k, v, causal=self.causal)


class _SeqMpu:
    """What DeepSpeed's uneven-head path asks ``groups.mpu`` for: the SP group and rank."""

    def __init__(self, group) -> None:
        self.group = group

    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)


def _inputs(length, heads, kv_heads, n, r, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(heads,), (kv_heads,), (kv_heads,), (heads,)]  # q, k, v, output weight
    full = [torch.randn(B, length, h, D, dtype=torch.float64, generator=gen) for (h,) in shapes]
    off, size = sum(shard_sizes(length, n)[:r]), shard_sizes(length, n)[r]
    return [t[:, off : off + size].clone() for t in full]


def _both(group, n, r, length, heads, kv_heads, causal, seed):
    """Outputs and grads of DeepSpeed's and our Ulysses on the same local shards."""
    from deepspeed.sequence.layer import DistributedAttention

    q, k, v, w = _inputs(length, heads, kv_heads, n, r, seed)
    results = []
    for which in ("deepspeed", "ours"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if which == "deepspeed":
            layer = DistributedAttention(
                _LocalAttention(causal), group, scatter_idx=2, gather_idx=1
            )
            out = layer(*leaves, 0)  # batch_dim_idx=0: [B, S/N, H, D]
        else:
            lengths = shard_sizes(length, n)
            out = ulysses_attention(*leaves, group=group, seq_lengths=lengths, causal=causal)
        (out * w).sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    return results


def _compare_with_deepspeed(rank: int, world: int) -> int:
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    sp_groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    checks = 0
    for n, group in sp_groups.items():
        if rank >= n:
            continue
        r = dist.get_rank(group)
        ds_groups.mpu = _SeqMpu(group)
        cases = [(12, 12, 12), (12, 2 * n, n)]  # divisible: MHA, and GQA with Hkv % N == 0
        cases += [(12, 2 * n + 1, 2 * n + 1)]  # heads not divisible by N (uneven head split)
        for length, heads, kv_heads in cases:
            for causal in (False, True):
                checks += 1
                theirs, ours = _both(group, n, r, length, heads, kv_heads, causal, checks)
                what = f"SP {n} (L, H, Hkv) = {(length, heads, kv_heads)} causal={causal}"
                for name, a, b in zip(("out", "dq", "dk", "dv"), theirs, ours):
                    torch.testing.assert_close(
                        a,
                        b,
                        rtol=1e-12,
                        atol=1e-12,
                        msg=lambda m, name=name, what=what: f"{what} {name}: {m}",
                    )
        if n == 4:  # fewer heads than ranks: DeepSpeed refuses (ours runs, some ranks idle)
            with pytest.raises(AssertionError, match="at least the sequence parallel size"):
                _both(group, n, r, 12, 3, 3, False, 0)
            checks += 1
    ds_groups.mpu = None
    return checks


def test_deepspeed_ulysses_equals_ours_on_divisible_shapes_and_uneven_heads():
    checks = run_distributed(_compare_with_deepspeed, 4, timeout=240)
    assert checks == [19, 19, 13, 7]


def _deepspeed_uneven_sequence(rank: int, world: int) -> tuple:
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    # a short timeout: the rank left waiting for a mismatched exchange gives up quickly
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    length, n = 7, 2
    q, k, v, _ = _inputs(length, 4, 4, n, rank, 0)  # balanced shards: 4 and 3 tokens
    layer = DistributedAttention(_LocalAttention(False), group, scatter_idx=2, gather_idx=1)
    out = layer(q, k, v, 0)
    return tuple(out.shape)


def test_deepspeed_fails_on_a_sequence_length_sp_does_not_divide():
    """L = 7 at SP 2: DeepSpeed's equal-split all-to-all cannot exchange 4 + 3 token shards."""
    try:
        shapes = run_distributed(_deepspeed_uneven_sequence, 2, timeout=120)
    except (AssertionError, TimeoutError) as exc:  # a worker aborted, raised or hung
        text = str(exc)
        assert any(
            s in text
            for s in ("died without reporting", "Received data size", "Connection closed", "timed")
        ), text
        return
    # should it ever return, the shapes cannot be this rank's 4 and 3 tokens of 7
    assert [s[1] for s in shapes] != shard_sizes(7, 2), shapes

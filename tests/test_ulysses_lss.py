"""Ulysses and LSS attention at SP 2, 3 and 4 against naive single-process attention.

One 4-process spawn builds the sub-groups {0, 1} and {0, 1, 2} (every rank creates every group,
in the same order) plus the world, and runs every case on each group it belongs to: uneven
sequences (7, 11, shorter than N), uneven heads (3, 5), GQA/MQA, causal or not, fp64 and fp32.
Each rank compares its output slice and its dq, dk, dv with the single-process reference on
the gathered tensors (loss ``Σ w·out``), and the traced bytes with the documented formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.parallel import comm
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.methods import lss, lss_attention, ulysses_attention
from dspzoo.core.parallel.methods.lss_offload import lss_offloads, visible_keys
from dspzoo.core.parallel.methods.ring import ring_positions, zigzag_lengths
from dspzoo.core.parallel.methods.ulysses import kv_heads_aligned
from dspzoo.core.parallel.trace import CommTracer, trace_comm
from dspzoo.core.testing import run_distributed

B, D = 2, 4

# (L, H, Hkv): uneven lengths and heads, GQA/MQA, L shorter than N, and divisible shapes
CASES = [
    (7, 3, 3),
    (11, 5, 5),
    (8, 4, 2),
    (11, 4, 1),
    (2, 4, 4),
    (1, 3, 1),
    (12, 12, 12),
    (12, 12, 4),
]
# non-balanced splits (exchanged with their own partition, no padding)
ODD_SPLITS = {2: [[0, 5], [4, 1]], 3: [[5, 1, 2]], 4: [[2, 0, 4, 1]]}


def naive(q, k, v, causal, scale=None):
    """softmax(q kᵀ · scale) v on ``[B, L, H, D]`` with KV head ``h // g`` for query head ``h``."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _reference(shape, causal, dtype, scale, seed):
    length, heads, kv_heads = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, length, heads, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, length, kv_heads, D, dtype=torch.float64, generator=gen)
    v = torch.randn(B, length, kv_heads, D, dtype=torch.float64, generator=gen)
    w = torch.randn(B, length, heads, D, dtype=torch.float64, generator=gen)
    q, k, v, w = (t.to(dtype) for t in (q, k, v, w))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = naive(*(t.double() for t in leaves), causal, scale)
    (out * w.double()).sum().backward()
    return (q, k, v, w), out.detach(), [t.grad for t in leaves]


def _ulysses_bytes(lengths, heads, kv_heads, n, r, itemsize):
    """Per-phase bytes of Ulysses' four switches on rank ``r`` (general formula)."""
    hs = shard_sizes(heads, n)
    hk = shard_sizes(kv_heads, n) if kv_heads_aligned(heads, kv_heads, n) else hs
    others = [d for d in range(n) if d != r]
    fwd = sum(lengths[r] * (hs[d] + 2 * hk[d]) + hs[r] * lengths[d] for d in others)
    bwd = sum(lengths[d] * (hs[r] + 2 * hk[r]) + hs[d] * lengths[r] for d in others)
    return fwd * B * D * itemsize, bwd * B * D * itemsize


def _run_case(method, group, n, r, lengths, shape, causal, dtype, scale, seed, **kw):
    (q, k, v, w), out_ref, grads_ref = _reference(shape, causal, dtype, scale, seed)
    size = lengths[r]
    pos = ring_positions(lengths, r, getattr(method, "layout", "contiguous"))

    def mine(t):
        return t[:, pos].clone()

    leaves = [mine(t).requires_grad_(True) for t in (q, k, v)]
    with trace_comm() as tracer:
        out = method(*leaves, group=group, seq_lengths=lengths, causal=causal, scale=scale, **kw)
        (out * mine(w)).sum().backward()
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    what = f"{method.__name__} n={n} lengths={lengths} shape={shape} causal={causal} {dtype}"
    assert out.dtype == dtype and out.shape == (B, size, shape[1], D), what
    torch.testing.assert_close(out.double(), mine(out_ref), **tol, msg=lambda m: f"{what} out: {m}")
    for name, leaf, ref in zip("qkv", leaves, grads_ref):
        torch.testing.assert_close(
            leaf.grad.double(),
            mine(ref).double(),
            **tol,
            msg=lambda m, name=name: f"{what} d{name}: {m}",
        )
    return tracer


def _check_bytes(tracer, method, n, r, lengths, shape, itemsize, causal=False):
    length, heads, kv_heads = shape
    if method == "lss_balanced":  # LSS's collectives plus the lent rows: q, out; dO, dQ
        loan = [x for x in lss_offloads(lengths) if r in (x.owner, x.helper)] if causal else []
        row_bytes = loan[0].rows * B * heads * D * itemsize if loan else 0
        for phase in ("forward", "backward"):
            assert tracer.count(op="p2p", phase=phase) == (1 if loan else 0), (phase, lengths)
            assert tracer.total_bytes(op="p2p", phase=phase) == row_bytes, (phase, lengths)
        tracer = CommTracer([x for x in tracer.records if x.op != "p2p"])
        method = "lss"
    fwd, bwd = tracer.total_bytes(phase="forward"), tracer.total_bytes(phase="backward")
    if method == "ulysses":
        # fused: [q|k|v] and the output, or q, [k|v] and the output for KV-aligned GQA
        switches = 3 if kv_heads != heads and kv_heads_aligned(heads, kv_heads, n) else 2
        assert tracer.count(op="all_to_all", phase="forward") == switches
        assert tracer.count(op="all_to_all", phase="backward") == switches
        assert tracer.count() == 2 * switches
        assert tracer.total_bytes(region_prefix="ulysses") == fwd + bwd
        assert (fwd, bwd) == _ulysses_bytes(lengths, heads, kv_heads, n, r, itemsize), (
            shape,
            lengths,
        )
        if length % n == 0 and heads % n == 0:  # the closed forms of the docstring
            local = B * (length // n) * heads * D * itemsize
            kv_share = kv_heads / heads if kv_heads_aligned(heads, kv_heads, n) else 1
            assert fwd == bwd == (2 + 2 * kv_share) * local * (n - 1) / n
            if kv_heads == heads:
                assert fwd == 4 * local * (n - 1) / n
    else:
        # one fused all-gather of [k|v] forward, one reduce-scatter backward
        assert tracer.count(op="all_gather", phase="forward") == 1 and tracer.count() == 2
        assert tracer.count(op="reduce_scatter", phase="backward") == 1
        assert tracer.total_bytes(region_prefix="lss") == fwd + bwd
        assert fwd == bwd == (n - 1) * max(lengths) * B * kv_heads * 2 * D * itemsize
        if length % n == 0:  # (N−1)/N of the global K and V bytes
            assert fwd == (n - 1) * (2 * B * length * kv_heads * D * itemsize) // n


def _lss_fallback(q, k, v, chunk=2, **kw):
    """LSS with the blockwise kernel hidden: ``attend`` with masks per query chunk."""
    saved = lss._blockwise_kernel
    lss._blockwise_kernel = lambda: None
    try:
        return lss.lss_attention(q, k, v, chunk=chunk, **kw)
    finally:
        lss._blockwise_kernel = saved


def _lss_small_chunks(q, k, v, **kw):
    """The blockwise kernel on chunks of 3 (the fused kernel does not chunk)."""
    return lss_attention(q, k, v, chunk=3, kernel="blockwise", **kw)


def _lss_zigzag(q, k, v, **kw):
    """LSS on the zigzag layout (``seq_lengths`` are the balanced lengths it replaces)."""
    return lss_attention(q, k, v, **{**kw, "layout": "zigzag"})


def _lss_zigzag_blockwise(q, k, v, **kw):
    return lss_attention(q, k, v, **{**kw, "layout": "zigzag", "kernel": "blockwise", "chunk": 2})


def _lss_zigzag_fallback(q, k, v, **kw):
    return _lss_fallback(q, k, v, **{**kw, "layout": "zigzag"})


for _fn in (_lss_zigzag, _lss_zigzag_blockwise, _lss_zigzag_fallback):
    _fn.layout = "zigzag"


def _lss_balanced(q, k, v, **kw):
    """LSS on the contiguous layout, the later rank of each pair lending query rows."""
    return lss_attention(q, k, v, balanced=True, **kw)


def _lss_balanced_blockwise(q, k, v, **kw):
    return lss_attention(q, k, v, balanced=True, kernel="blockwise", chunk=2, **kw)


METHODS = {
    "ulysses": ulysses_attention,
    "lss": lss_attention,
    "lss_chunk3": _lss_small_chunks,
    "lss_fallback": _lss_fallback,
    "lss_zigzag": _lss_zigzag,
    "lss_zigzag_blockwise": _lss_zigzag_blockwise,
    "lss_zigzag_fallback": _lss_zigzag_fallback,
    "lss_balanced": _lss_balanced,
    "lss_balanced_blockwise": _lss_balanced_blockwise,
}
ZIGZAG = ("lss_zigzag", "lss_zigzag_blockwise", "lss_zigzag_fallback")
BALANCED = ("lss_balanced", "lss_balanced_blockwise")


def _check_group(group, n, r, seed):
    checks = lent = 0
    runs = [(list(shard_sizes(s[0], n)), s, torch.float64, None) for s in CASES]
    runs += [(split, (sum(split), 4, 2), torch.float64, None) for split in ODD_SPLITS[n]]
    runs += [(shard_sizes(9, n), (9, 5, 5), torch.float32, None)]  # fp32, 1e-5
    runs += [(shard_sizes(10, n), (10, 6, 3), torch.float64, 0.3)]  # explicit scale
    for lengths, shape, dtype, scale in runs:
        for causal in (False, True):
            for name, method in METHODS.items():
                if name in ("lss_chunk3", "lss_fallback", *ZIGZAG[1:], *BALANCED) and not causal:
                    continue  # their non-causal paths are the single-call ones already covered
                run_lengths = lengths
                if name in ZIGZAG:
                    if lengths != shard_sizes(sum(lengths), n):
                        continue  # the zigzag layout has its own lengths
                    run_lengths = zigzag_lengths(sum(lengths), n)
                seed += 1
                tracer = _run_case(
                    method, group, n, r, run_lengths, shape, causal, dtype, scale, seed
                )
                kind = "ulysses" if name == "ulysses" else "lss"
                kind = "lss_balanced" if name in BALANCED else kind
                _check_bytes(tracer, kind, n, r, run_lengths, shape, dtype.itemsize, causal)
                checks += 1
                lent += tracer.count(op="p2p") > 0
    # one rank asking for balanced work where the others do not: the same error on every rank
    q, k, v = (torch.zeros(B, shard_sizes(7, n)[r], 2, D) for _ in range(3))
    with pytest.raises(comm.CollectiveInputError, match="balanced"):
        lss_attention(
            q, k, v, group=group, seq_lengths=shard_sizes(7, n), causal=True, balanced=r == 0
        )
    with pytest.raises(comm.CollectiveInputError, match="balanced=True balances the contiguous"):
        lss_attention(
            q, k, v, group=group, seq_lengths=shard_sizes(7, n), causal=True, balanced=True,
            layout="zigzag",
        )  # fmt: skip
    # one rank on the zigzag layout where the others are contiguous: agreed, so the same error
    zig = zigzag_lengths(7, n)
    q, k, v = (torch.zeros(B, zig[r], 2, D) for _ in range(3))
    with pytest.raises(comm.CollectiveInputError, match="layout"):
        lss_attention(
            q, k, v, group=group, seq_lengths=zig, causal=True,
            layout="zigzag" if r == 0 else "contiguous",
        )  # fmt: skip
    # every rank of SP 2 and 4 is in a pair, and most cases lend rows (1 of 3 ranks at SP 3)
    assert lent > 0 or (n == 3 and r == 1), f"lss_balanced lent no rows at n={n} rank {r}"
    return checks


def _check_all(rank: int, world: int) -> dict[int, int]:
    torch.set_num_threads(1)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    done = {}
    for n, group in groups.items():
        if rank < n:
            done[n] = _check_group(group, n, dist.get_rank(group), seed=1000 * n)
    return done


def test_ulysses_and_lss_match_single_process_at_sp_2_3_4():
    results = run_distributed(_check_all, 4, timeout=180)
    assert results[0] == results[1] and set(results[0]) == {2, 3, 4}
    assert results[2].keys() == {3, 4} and results[3].keys() == {4}
    assert all(count > 0 for count in results[0].values())


# --------------------------------------------------------------------------------------------
# one process: the group of one, argument errors


@pytest.mark.parametrize("method", [ulysses_attention, lss_attention, _lss_fallback])
@pytest.mark.parametrize("causal", [False, True])
def test_single_process_equals_naive(method, causal):
    (q, k, v, w), out_ref, grads = _reference((9, 6, 2), causal, torch.float64, None, 7)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = method(*leaves, group=None, seq_lengths=[9], causal=causal)
    (out * w).sum().backward()
    torch.testing.assert_close(out, out_ref)
    for leaf, ref in zip(leaves, grads):
        torch.testing.assert_close(leaf.grad, ref)


@pytest.mark.parametrize("method", [ulysses_attention, lss_attention])
def test_argument_errors_are_clear(method):
    q, kv = torch.zeros(1, 4, 6, 2), torch.zeros(1, 4, 4, 2)
    with pytest.raises(ValueError, match="must divide the 6 query heads"):
        method(q, kv, kv, group=None, seq_lengths=[4])
    q, kv = torch.zeros(1, 4, 4, 2), torch.zeros(1, 4, 2, 2)
    with pytest.raises(ValueError, match="seq_lengths has 2 entries"):
        method(q, kv, kv, group=None, seq_lengths=[2, 2])
    with pytest.raises(ValueError, match="rank 0 holds 4 tokens of q"):
        method(q, kv, kv, group=None, seq_lengths=[5])
    with pytest.raises(ValueError, match="differ in shape"):
        method(q, kv, kv[:, :, :1], group=None, seq_lengths=[4])


def test_kv_alignment_rule():
    assert kv_heads_aligned(8, 4, 4) and kv_heads_aligned(5, 5, 4)  # Hkv % N == 0, or MHA
    assert kv_heads_aligned(4, 2, 2) and not kv_heads_aligned(4, 2, 3)
    assert not kv_heads_aligned(4, 1, 2) and not kv_heads_aligned(12, 4, 3)
    assert kv_heads_aligned(12, 12, 3) and kv_heads_aligned(12, 4, 2)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_lss_saves_no_score_matrix(fallback, causal):
    """What autograd keeps is O(L·D), far below the L × L scores (blockwise kernel or fallback)."""
    from dspzoo.core.parallel.trace import SavedTensorMeter

    length, heads = 1024, 2
    q = torch.randn(1, length, heads, 8, requires_grad=True)
    k, v = (torch.randn(1, length, 1, 8, requires_grad=True) for _ in range(2))
    method = _lss_fallback if fallback else lss_attention
    with SavedTensorMeter() as meter:
        out = method(q, k, v, group=None, seq_lengths=[length], causal=causal, chunk=128)
    out.sum().backward()
    assert meter.bytes < length * length * heads * 4 / 16
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("n", range(2, 9))
def test_lss_offloads_balance_the_causal_work(n):
    """After the loans every rank's visible (query, key) pairs are within one row's keys of the
    best split, for equal and uneven shards; the lent rows are the owner's tail."""
    for total in (n * 64, n * 64 + n // 2, 7 * n + 1):
        lengths = shard_sizes(total, n)
        offsets = [sum(lengths[:j]) for j in range(n)]
        work = [visible_keys(o, o + s) for o, s in zip(offsets, lengths)]
        loans = lss_offloads(lengths)
        assert {loan.helper for loan in loans} <= set(range(n // 2))
        for loan in loans:
            assert (
                loan.owner == n - 1 - loan.helper and loan.row0 + loan.rows == lengths[loan.owner]
            )
            end = offsets[loan.owner] + lengths[loan.owner]
            moved = visible_keys(end - loan.rows, end)
            work[loan.owner] -= moved
            work[loan.helper] += moved
            assert abs(work[loan.owner] - work[loan.helper]) <= end, (lengths, loan)
        if total >= 64 * n:  # equal blocks: every rank within 2 % of the mean (before: 2N−1)/N
            mean = sum(work) / n
            assert max(work) / mean < 1.02, (lengths, work)

"""Blockwise attention, ring p2p exchange, ring attention and USP against naive attention.

Single-process tests cover the blockwise pieces (forward, merge, FlashAttention-2 backward,
chunked attention). One 4-process spawn covers every distributed case: SP 2, 3 and 4 on the
world group and on sub-groups, uneven and empty shards, causal or not, contiguous and zigzag,
GQA, the traced bytes, and USP at 2 × 2.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspzoo.core.parallel.methods import (
    block_attention,
    block_attention_backward,
    chunked_attention,
    merge,
)
from dspzoo.core.parallel.methods.blockwise import attention_delta
from dspzoo.core.testing import run_distributed


def naive_attention(q, k, v, causal=False, q_pos=None, k_pos=None, mask=None, scale=None):
    """softmax(Q Kᵀ · scale) V on [B, L, H, D] with GQA; fully masked rows give 0."""
    h, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    vis = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        qp = torch.arange(q.shape[1]) if q_pos is None else q_pos
        kp = torch.arange(k.shape[1]) if k_pos is None else k_pos
        vis = kp[None, :] <= qp[:, None]
    if mask is not None:
        vis = vis & mask
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _qkv(b, lq, lk, h, hkv, d, dtype=torch.float64, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, lk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(b, lk, hkv, dv or d, generator=g, dtype=dtype)
    return q, k, v


def _grads(fn, q, k, v, w):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


CASES = [  # (lq, lk, h, hkv, causal, q offset, k offset)
    (5, 7, 4, 2, False, 0, 0),
    (5, 7, 4, 2, True, 3, 0),  # queries at 3..7, keys at 0..6: partly masked
    (6, 6, 3, 1, True, 0, 0),
    (4, 9, 2, 2, True, 0, 2),  # query 0 and 1 see nothing: fully masked rows
    (3, 5, 4, 4, True, 0, 10),  # whole block in the future
    (0, 5, 2, 1, True, 0, 0),  # empty query block
    (4, 0, 2, 1, False, 0, 0),  # empty key block
]


@pytest.mark.parametrize("case", CASES)
def test_block_attention_and_backward_match_naive(case):
    lq, lk, h, hkv, causal, qo, ko = case
    q, k, v = _qkv(2, lq, lk, h, hkv, 8, dv=6)
    qp, kp = torch.arange(lq) + qo, torch.arange(lk) + ko
    w = torch.randn(2, lq, h, 6, dtype=torch.float64)
    kw = dict(causal=causal, q_pos=qp, k_pos=kp)
    ref = _grads(lambda a, b, c: naive_attention(a, b, c, **kw), q, k, v, w)
    got = _grads(lambda a, b, c: block_attention(a, b, c, **kw)[0], q, k, v, w)
    for r, g in zip(ref, got):
        assert not g.isnan().any()
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    out, lse = block_attention(q, k, v, **kw)
    assert lse.shape == (2, h, lq) and lse.dtype == torch.float64
    dq, dk, dv = block_attention_backward(q, k, v, out, lse, w, **kw)
    for r, g in zip(ref[1:], (dq, dk, dv)):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_block_attention_fully_masked_rows_and_user_mask():
    q, k, v = _qkv(1, 3, 4, 2, 2, 4)
    mask = torch.tensor([[True, False, False, False], [False] * 4, [True] * 4])
    out, lse = block_attention(q, k, v, mask=mask)
    assert torch.isneginf(lse[:, :, 1]).all() and (out[:, 1] == 0).all()
    torch.testing.assert_close(out, naive_attention(q, k, v, mask=mask), rtol=1e-10, atol=1e-12)
    # gradients through a fully masked row are zero, not NaN
    q.requires_grad_(True)
    out, lse = block_attention(q, k, v, mask=mask)
    (out.sum() + lse[:, :, [0, 2]].sum()).backward()
    assert not q.grad.isnan().any() and (q.grad[:, 1] == 0).all()


def test_merge_of_key_splits_equals_whole_and_is_inf_safe():
    q, k, v = _qkv(2, 6, 9, 4, 2, 8)
    kw = dict(causal=True, q_pos=torch.arange(6) + 2, k_pos=torch.arange(9))
    whole, whole_lse = block_attention(q, k, v, **kw)
    acc = torch.zeros_like(whole)
    acc_lse = torch.full_like(whole_lse, -math.inf)
    for s in (slice(0, 4), slice(4, 5), slice(5, 9)):
        o, lse = block_attention(
            q, k[:, s], v[:, s], causal=True, q_pos=kw["q_pos"], k_pos=kw["k_pos"][s]
        )
        acc, acc_lse = merge(acc, acc_lse, o, lse)
    torch.testing.assert_close(acc, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc_lse, whole_lse, rtol=1e-12, atol=1e-12)
    empty = torch.full_like(whole_lse, -math.inf)
    o, lse = merge(torch.zeros_like(whole), empty, torch.zeros_like(whole), empty)
    assert torch.isneginf(lse).all() and (o == 0).all()
    # fp32 statistics for half inputs
    o16, l16 = block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o16.dtype == torch.bfloat16 and l16.dtype == torch.float32
    om, lm = merge(o16, l16, o16, l16)
    assert om.dtype == torch.float32 and lm.dtype == torch.float32
    d = attention_delta(whole, whole)
    assert d.shape == whole_lse.shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_attention_matches_naive(dtype, causal):
    q, k, v = _qkv(2, 11, 13, 4, 2, 8, dtype=dtype)
    qp, kp = torch.arange(11) + 2, torch.arange(13)
    w = torch.randn(2, 11, 4, 8, dtype=dtype)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    kw = dict(causal=causal, q_pos=qp, k_pos=kp)
    ref = _grads(lambda a, b, c: naive_attention(a, b, c, **kw), q, k, v, w)
    for chunk in (1, 3, 4, 64):
        got = _grads(lambda a, b, c, n=chunk: chunked_attention(a, b, c, chunk=n, **kw), q, k, v, w)
        for r, g in zip(ref, got):
            assert g.dtype == dtype
            torch.testing.assert_close(g, r, **tol)


def test_chunked_attention_saves_only_inputs_and_output():
    from dspzoo.core.parallel.trace import SavedTensorMeter

    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 64, 64, 2, 2, 4, dtype=torch.float32))
    with SavedTensorMeter() as meter:
        out = chunked_attention(q, k, v, causal=True, chunk=8)
    saved = sum(t.numel() * 4 for t in (q, k, v, out)) + 1 * 2 * 64 * 4  # + lse
    assert meter.bytes <= saved + 2 * 64 * 8  # + positions


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_balanced_schedule_covers_every_pair_once_and_balances_the_work(n):
    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.balanced import balanced_schedule

    for lengths in (shard_sizes(8 * n, n), shard_sizes(8 * n + n - 1, n), [0, *[4] * (n - 1)]):
        steps = balanced_schedule(lengths)
        assert len(steps) == n // 2
        covered = {}  # (query rank, query row, key rank) -> times computed
        work = [0] * n  # (query, key) pairs each rank computes beyond its own diagonal
        for d, step in enumerate(steps, start=1):
            for at, t in step.items():
                assert t.at == at and at in (t.query, t.key) and t.key < t.query
                assert {t.query, t.key} == {at, (at - d) % n}  # the pair of the step's shift
                work[at] += (t.row1 - t.row0) * lengths[t.key]
                for row in range(t.row0, t.row1):
                    covered[(t.query, row, t.key)] = covered.get((t.query, row, t.key), 0) + 1
        wanted = {
            (i, row, j)
            for i in range(n)
            for j in range(i)
            if lengths[j]
            for row in range(lengths[i])
        }
        assert set(covered) == wanted and set(covered.values()) <= {1}, (n, lengths)
        if len(set(lengths)) == 1:  # equal blocks: every rank the same number of pairs
            assert max(work) == min(work), (n, work)
        elif 0 not in lengths:  # blocks uneven by a token: each pair by at most a block's row
            assert max(work) - min(work) <= (n // 2 + 1) * max(lengths), (n, lengths, work)


# --------------------------------------------------------------------------------------------
# distributed: one 4-process spawn for every case

B, H, HKV, D = 2, 4, 2, 4


def _full(length, dtype, seed, h=H, hkv=HKV):
    q, k, v = _qkv(B, length, length, h, hkv, D, dtype=dtype, seed=seed)
    w = torch.randn(B, length, h, D, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return q, k, v, w


def _run_against_one_process(attend, lengths, pos, causal, dtype, seed, what):
    """Run ``attend(q, k, v)`` on this rank's rows ``pos`` of a sequence over ``lengths``
    under the tracer; check the output and dq, dk, dv against single-process attention (fp64
    reference on the same values) and that only the local q, k, v, out and the statistics-dtype
    lse are saved (memory O(L/N)). Returns the tracer."""
    from dspzoo.core.parallel.trace import SavedTensorMeter, trace_comm

    q, k, v, w = _full(sum(lengths), dtype, seed)
    exact = [t.double() for t in (q, k, v, w)]  # the reference in fp64 on the same values
    ref = _grads(lambda a, b, c: naive_attention(a, b, c, causal=causal), *exact)
    loc = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
    with trace_comm() as tracer:
        with SavedTensorMeter() as meter:
            out = attend(*loc)
        (out * w[:, pos]).sum().backward()
    saved = sum(t.numel() * t.element_size() for t in (*loc, out)) + B * H * len(pos) * _stat(dtype)
    assert meter.bytes == saved, (what, meter.bytes, saved)
    tol = {
        torch.float64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-5, atol=1e-5),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    }[dtype]
    for name, got, want in zip("out dq dk dv".split(), [out.detach()] + [t.grad for t in loc], ref):
        assert got.dtype == dtype, what
        torch.testing.assert_close(
            got.double(), want[:, pos], **tol, msg=lambda m, nm=name: f"{what} {nm}: {m}"
        )
    return tracer


def _stat(dtype):
    """Bytes of the softmax statistics for inputs of ``dtype`` (fp64 stays, else fp32)."""
    return 8 if dtype == torch.float64 else 4


def _check_ring_case(group, lengths, layout, causal, dtype, seed, kernel=None):
    """Ring attention on this rank's shard equals its rows of single-process attention."""
    import torch.distributed as dist

    from dspzoo.core.parallel.comm.group import group_rank, group_size
    from dspzoo.core.parallel.methods.ring import ring_attention, ring_positions

    n, r = group_size(group), group_rank(group)
    what = f"n={n} lengths={lengths} {layout} causal={causal} {dtype} kernel={kernel}"
    tracer = _run_against_one_process(
        lambda q, k, v: ring_attention(
            q, k, v, group=group, seq_lengths=lengths, causal=causal, layout=layout, kernel=kernel
        ),
        lengths,
        ring_positions(lengths, r, layout),
        causal,
        dtype,
        seed,
        what,
    )
    # bytes sent: K and V of the blocks of ranks r, r−1, …, r−N+2 (forward and again in
    # backward) and the dK/dV accumulators of the blocks of ranks r, …, r−N+1 (backward)
    per_token = B * HKV * D * 2  # elements of K and V per token
    kv = (
        sum(lengths[(r - s) % n] for s in range(n - 1)) * per_token * (torch.finfo(dtype).bits // 8)
    )
    dkv = sum(lengths) * per_token * _stat(dtype)  # accumulators in the statistics dtype
    assert tracer.total_bytes("p2p", "forward") == kv, what
    assert tracer.total_bytes("p2p", "backward") == kv + dkv, what
    assert tracer.count("p2p", "forward") == 2 * (n - 1), what
    assert tracer.count() == tracer.count("p2p"), what
    dist.barrier(group)
    return 1


def _check_balanced_case(group, lengths, causal, dtype, seed, kernel=None):
    """The balanced ring on this rank's contiguous shard equals its rows of single-process
    attention (forward, dq, dk, dv), saves what ring saves, and sends its formula's bytes."""
    import torch.distributed as dist

    from dspzoo.core.parallel.comm.group import group_rank, group_size
    from dspzoo.core.parallel.methods.balanced import balanced_ring_attention
    from dspzoo.core.parallel.methods.registry import AttentionShape, CommCount, get_method
    from dspzoo.core.parallel.methods.ring import ring_positions

    n, r = group_size(group), group_rank(group)
    what = f"balanced n={n} lengths={lengths} causal={causal} {dtype} kernel={kernel}"
    tracer = _run_against_one_process(
        lambda q, k, v: balanced_ring_attention(
            q, k, v, group=group, seq_lengths=lengths, causal=causal, kernel=kernel
        ),
        lengths,
        ring_positions(lengths, r),
        causal,
        dtype,
        seed,
        what,
    )
    want = CommCount()
    shape = AttentionShape(tuple(lengths), B, H, HKV, D, torch.finfo(dtype).bits // 8, 1, causal)
    get_method("ring_balanced").attention_bytes(want, shape, r)
    for phase in ("forward", "backward"):
        assert tracer.total_bytes("p2p", phase) == want.bytes("p2p", phase), (what, phase)
        assert tracer.count("p2p", phase) == want.count("p2p", phase), (what, phase)
    assert tracer.count() == tracer.count("p2p"), what
    dist.barrier(group)
    return 1


def _check_balanced_refuses_a_wrong_shard_on_every_rank(rank):
    """Rank 0 passes one token too many: every rank raises the same error (none waits)."""
    import torch.distributed as dist

    from dspzoo.core import comm
    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.balanced import balanced_ring_attention

    lengths, world = shard_sizes(9, 4), dist.group.WORLD
    q, k, v = _qkv(B, lengths[rank] + (rank == 0), lengths[rank] + (rank == 0), H, HKV, D)
    with pytest.raises(comm.CollectiveInputError, match="rank 0 should hold 3 tokens"):
        balanced_ring_attention(q, k, v, group=world, seq_lengths=lengths, causal=True)
    return 1


def _check_exchange_and_zigzag(group):
    import torch.distributed as dist

    from dspzoo.core import comm
    from dspzoo.core.parallel.comm.group import group_rank, group_size
    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.ring import zigzag_gather, zigzag_positions, zigzag_split
    from dspzoo.core.parallel.trace import trace_comm

    n, r = group_size(group), group_rank(group)
    sizes = shard_sizes(2 * n - 1, n)  # uneven: the last rank holds fewer rows
    for shift in (1, -1, 2, n):
        x = torch.full((sizes[r], 3), float(r), dtype=torch.float64, requires_grad=True)
        src, dst = (r - shift) % n, (r + shift) % n
        with trace_comm() as tracer:
            y = comm.ring_exchange(x, group, shift=shift, recv_shape=(sizes[src], 3))
            (y * (r + 1)).sum().backward()
        assert y.shape == (sizes[src], 3) and (y == src).all(), (shift, y)
        assert (x.grad == dst + 1).all(), (shift, x.grad)
        nbytes = x.numel() * 8 if n > 1 else 0
        if shift % n == 0:
            nbytes = 0
        assert tracer.total_bytes("p2p", "forward") == nbytes
    # zigzag split / gather, values and gradients, lengths not divisible by 2N and shorter than N
    for length in (7, 11, n - 1):
        gen = torch.Generator().manual_seed(length)  # the same on every rank
        full = torch.randn(2, length, 3, dtype=torch.float64, generator=gen)
        weight = torch.randn(2, length, 3, dtype=torch.float64, generator=gen)
        pos = zigzag_positions(length, n, r)
        x = full.clone().requires_grad_(True)
        y = zigzag_split(x, 1, group)
        torch.testing.assert_close(y, full[:, pos])
        (y * weight[:, pos]).sum().backward()
        g = x.grad.clone()
        dist.all_reduce(g, group=group)
        torch.testing.assert_close(g, weight)
        s = full[:, pos].clone().requires_grad_(True)
        z = zigzag_gather(s, 1, group, length)
        torch.testing.assert_close(z, full)
        ((z * weight).sum() / n).backward()
        torch.testing.assert_close(s.grad, weight[:, pos])
    return 1


def _check_usp(ulysses, ring, rank):
    from dspzoo.core.parallel.comm.group import group_rank, group_size
    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.ring import zigzag_lengths
    from dspzoo.core.parallel.methods.usp import usp_attention, usp_positions

    u_size, u, j = group_size(ulysses), group_rank(ulysses), group_rank(ring)
    assert rank == j * u_size + u
    checks = 0
    for length, layout, causal, hkv in [
        (11, "contiguous", True, 2),
        (7, "zigzag", True, 1),  # Hkv < U: keys/values repeated to H heads
        (9, "zigzag", False, 4),
        (3, "contiguous", False, 2),  # some ranks hold no token
    ]:
        lengths = shard_sizes(length, 2) if layout == "contiguous" else zigzag_lengths(length, 2)
        q, k, v, w = _full(length, torch.float64, 40 + length, hkv=hkv)
        ref = _grads(lambda a, b, c, c_=causal: naive_attention(a, b, c, causal=c_), q, k, v, w)
        pos = usp_positions(lengths, j, u_size, u, layout)
        loc = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
        out = usp_attention(
            *loc,
            ulysses_group=ulysses,
            ring_group=ring,
            seq_lengths=lengths,
            causal=causal,
            layout=layout,
        )
        (out * w[:, pos]).sum().backward()
        for got, want in zip([out.detach()] + [t.grad for t in loc], ref):
            torch.testing.assert_close(got, want[:, pos], rtol=1e-10, atol=1e-12)
        checks += 1
    return checks


def _distributed_all(rank, world):
    import torch.distributed as dist

    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.ring import zigzag_lengths

    torch.manual_seed(0)
    # every rank creates every group, in the same order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    configs = [(pairs[rank // 2], 2)]
    if rank < 3:
        configs.append((triple, 3))
    configs.append((dist.group.WORLD, 4))
    custom = {2: [0, 5], 3: [4, 0, 3], 4: [0, 5, 2, 4]}
    checks = 0
    for group, n in configs:
        checks += _check_exchange_and_zigzag(group)
        for length in (7, 11, n - 1):
            for layout in ("contiguous", "zigzag"):
                lengths = (
                    shard_sizes(length, n) if layout == "contiguous" else zigzag_lengths(length, n)
                )
                for causal in (False, True):
                    checks += _check_ring_case(
                        group, lengths, layout, causal, torch.float64, length
                    )
        checks += _check_ring_case(group, custom[n], "contiguous", True, torch.float64, 3)
        for lengths in (shard_sizes(11, n), shard_sizes(n - 1, n), custom[n]):
            checks += _check_balanced_case(group, lengths, True, torch.float64, 7)
        checks += _check_balanced_case(group, shard_sizes(7, n), False, torch.float64, 8)
    for dtype in (torch.float32, torch.bfloat16):
        checks += _check_ring_case(
            dist.group.WORLD, zigzag_lengths(13, 4), "zigzag", True, dtype, 5
        )
    for dtype in (torch.float32, torch.bfloat16):
        checks += _check_balanced_case(dist.group.WORLD, shard_sizes(13, 4), True, dtype, 9)
    for group, n in configs:
        checks += _check_balanced_case(group, shard_sizes(9, n), True, torch.float64, 12)
    checks += _check_balanced_case(
        dist.group.WORLD, custom[4], True, torch.float64, 10, kernel="blockwise"
    )
    for layout, lengths in (("zigzag", zigzag_lengths(11, 4)), ("contiguous", custom[4])):
        checks += _check_ring_case(
            dist.group.WORLD, lengths, layout, True, torch.float64, 6, kernel="blockwise"
        )
    checks += _check_usp(pairs[rank // 2], rings[rank % 2], rank)
    checks += _check_balanced_refuses_a_wrong_shard_on_every_rank(rank)
    return checks


def test_ring_attention_p2p_zigzag_and_usp_at_sp_2_3_4():
    checks = run_distributed(_distributed_all, 4, timeout=180)
    assert checks[0] == checks[1] and checks[0] > checks[3] > 20, checks

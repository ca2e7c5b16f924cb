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

from dspzoo.core.methods import block_attention, block_attention_backward, chunked_attention, merge
from dspzoo.core.methods.blockwise import attention_delta


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
    from dspzoo.core.trace import SavedTensorMeter

    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 64, 64, 2, 2, 4, dtype=torch.float32))
    with SavedTensorMeter() as meter:
        out = chunked_attention(q, k, v, causal=True, chunk=8)
    saved = sum(t.numel() * 4 for t in (q, k, v, out)) + 1 * 2 * 64 * 4  # + lse
    assert meter.bytes <= saved + 2 * 64 * 8  # + positions

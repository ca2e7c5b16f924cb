"""Attention kernel dispatch: when flash-attn is chosen, the [N, L, H, D] layout contract, and
the SDPA path against a hand-written softmax(QKᵀ/√d)V."""

from __future__ import annotations

import math
import types
from unittest import mock

import pytest
import torch
from cuda_marks import CUDA

from dspzoo.core.layers import attention as attention_module
from dspzoo.core.layers.attention import attend, can_use_flash


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports ``is_cuda`` (the dispatch looks at nothing else)."""

    @property
    def is_cuda(self) -> bool:
        return True


def _q(dtype=torch.float16, head_dim=8, cuda=True, shape=(2, 5, 4)) -> torch.Tensor:
    q = torch.randn(*shape, head_dim).to(dtype)
    return q.as_subclass(FakeCuda) if cuda else q


def _fake_flash(*args, **kwargs):  # pragma: no cover - only its presence matters here
    raise AssertionError("not to be called")


@pytest.fixture
def flash_installed():
    with mock.patch.object(attention_module, "flash_attn_func", return_value=_fake_flash):
        yield


@pytest.fixture
def flash_absent():
    with mock.patch.object(attention_module, "flash_attn_func", return_value=None):
        yield


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, True),
        (torch.bfloat16, True),
        (torch.float32, False),
        (torch.float64, False),
    ],
)
def test_flash_only_for_half_precision_cuda(flash_installed, dtype, expected) -> None:
    assert can_use_flash(_q(dtype), None) is expected
    assert can_use_flash(_q(dtype, cuda=False), None) is False  # CPU: always SDPA


def test_flash_not_with_a_mask(flash_installed) -> None:
    q = _q()
    assert can_use_flash(q, None)
    assert not can_use_flash(q, torch.ones(5, 5, dtype=torch.bool))
    assert not can_use_flash(q, torch.ones(2, 1, 1, 5, dtype=torch.bool))


@pytest.mark.parametrize(
    ("head_dim", "expected"), [(64, True), (256, True), (257, False), (512, False)]
)
def test_flash_head_dim_limit(flash_installed, head_dim, expected) -> None:
    assert can_use_flash(_q(head_dim=head_dim, shape=(1, 2, 1)), None) is expected


def test_no_flash_when_flash_attn_is_absent(flash_absent) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        assert not can_use_flash(_q(dtype), None)


def test_flash_attn_func_import_is_guarded_and_cached() -> None:
    """Missing or broken flash-attn → None (import errors of any kind); present → its function."""
    fake_module = types.SimpleNamespace(flash_attn_func=_fake_flash)
    outcomes = [
        (ImportError("No module named 'flash_attn'"), None),
        (OSError("libcudart.so: cannot open shared object file"), None),
        (RuntimeError("flash-attn built for another CUDA"), None),
        (fake_module, _fake_flash),
    ]
    try:
        for result, expected in outcomes:
            attention_module.flash_attn_func.cache_clear()
            effect = (
                {"side_effect": result}
                if isinstance(result, Exception)
                else {"return_value": result}
            )
            with mock.patch.object(attention_module.importlib, "import_module", **effect) as imp:
                assert attention_module.flash_attn_func() is expected
                assert attention_module.flash_attn_func() is expected
            assert imp.call_count == 1 and imp.call_args.args == ("flash_attn",)  # cached
    finally:
        attention_module.flash_attn_func.cache_clear()


@pytest.mark.parametrize("causal", [False, True])
def test_flash_gets_nlhd_and_its_result_is_returned_unchanged(causal: bool) -> None:
    q, k, v = _q(torch.bfloat16), _q(torch.bfloat16), _q(torch.bfloat16)
    result = torch.randn(2, 5, 4, 8)
    calls = []

    def flash(*args, **kwargs):
        calls.append((args, kwargs))
        return result

    with mock.patch.object(attention_module, "flash_attn_func", return_value=flash):
        out = attend(q, k, v, causal=causal, dropout_p=0.1)
    assert out is result
    ((args, kwargs),) = calls
    assert len(args) == 3 and all(a is b for a, b in zip(args, (q, k, v)))  # no transposes
    assert kwargs == {"dropout_p": 0.1, "causal": causal, "softmax_scale": None}


def test_flash_chosen_but_mask_given_falls_back_to_sdpa() -> None:
    q = _q(torch.float32).to(torch.float16)
    mask = torch.rand(2, 1, 5, 5) > 0.5
    mask[..., 0] = True
    with mock.patch.object(attention_module, "flash_attn_func", return_value=_fake_flash):
        out = attend(q, q, q, mask=mask)
    assert out.shape == q.shape
    ref = _reference(q.double(), q.double(), q.double(), mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def _reference(q, k, v, mask=None, causal=False) -> torch.Tensor:
    """softmax(Q Kᵀ / √d) V per (sample, head), on [N, L, H, D] tensors."""
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("nhqk,nkhd->nqhd", scores.softmax(dim=-1), v)


def _qkv(lq: int, lk: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    n, h, d = 2, 3, 8
    q = torch.randn(n, lq, h, d, generator=g, dtype=dtype)
    k = torch.randn(n, lk, h, d, generator=g, dtype=dtype)
    v = torch.randn(n, lk, h, d, generator=g, dtype=dtype)
    return q, k, v


def _mask(shape, lk: int) -> torch.Tensor:
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True  # every query keeps a key (and the causal diagonal's first key)
    return mask.expand(*mask.shape[:-1], lk) if mask.shape[-1] == 1 else mask


@pytest.mark.parametrize(
    ("lq", "lk", "causal", "mask_shape"),
    [
        (6, 6, False, None),
        (4, 9, False, None),  # cross-attention: Lq ≠ Lk
        (6, 6, True, None),
        (6, 6, False, (2, 3, 6, 6)),  # full [N, H, Lq, Lk]
        (4, 9, False, (2, 1, 1, 9)),  # key padding, broadcast over heads and queries
        (6, 6, True, (2, 1, 6, 6)),  # causal and a mask together
    ],
)
def test_sdpa_path_equals_softmax_reference(lq, lk, causal, mask_shape) -> None:
    q, k, v = _qkv(lq, lk)
    mask = None if mask_shape is None else _mask(mask_shape, lk)
    assert not can_use_flash(q, mask)  # CPU
    out = attend(q, k, v, mask=mask, causal=causal)
    assert out.shape == (2, lq, 3, 8)  # [N, Lq, H, D]
    torch.testing.assert_close(out, _reference(q, k, v, mask, causal), rtol=1e-10, atol=1e-12)


def test_sdpa_path_attends_over_l_not_h() -> None:
    """Layout: changing one key token moves every query of that sample and head only."""
    q, k, v = _qkv(5, 5)
    base = attend(q, k, v)
    k2 = k.clone()
    k2[1, 3, 2] += 1.0  # sample 1, token 3, head 2
    changed = (attend(q, k2, v) - base).abs().amax(dim=-1) > 0  # [N, L, H]
    expected = torch.zeros(2, 5, 3, dtype=torch.bool)
    expected[1, :, 2] = True
    assert torch.equal(changed, expected)


# -- on a GPU: the real dispatch (flash-attn when importable, else SDPA's CUDA kernels) -----------
CUDA_TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("lq", "lk", "causal", "mask_shape", "kv_heads"),
    [
        (6, 6, False, None, 3),
        (4, 9, False, None, 3),
        (37, 37, True, None, 3),
        (37, 37, True, None, 1),  # GQA/MQA
        (6, 6, False, (2, 3, 6, 6), 3),
        (4, 9, False, (2, 1, 1, 9), 3),
        (6, 6, True, (2, 1, 6, 6), 3),
        (4, 9, True, None, 3),  # causal cross-attention: the explicit top-left mask
    ],
)
def test_cuda_dispatch_equals_softmax_reference(lq, lk, causal, mask_shape, kv_heads, dtype):
    """On CUDA tensors ``attend`` takes flash-attn exactly when ``can_use_flash`` says so, and
    every path equals the float64 CPU reference (forward and the inputs' gradients)."""
    q, k, v = _qkv(lq, lk)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    mask = None if mask_shape is None else _mask(mask_shape, lk)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    g = 3 // kv_heads
    ref = _reference(
        leaves[0],
        leaves[1].repeat_interleave(g, dim=2),
        leaves[2].repeat_interleave(g, dim=2),
        mask,
        causal,
    )
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (ref * w).sum().backward()
    on = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
    cuda_mask = None if mask is None else mask.cuda()
    flash = attention_module.flash_attn_func() is not None
    assert can_use_flash(on[0], cuda_mask) is (flash and dtype != torch.float32 and mask is None)
    out = attend(*on, mask=cuda_mask, causal=causal)
    (out * w.to("cuda", dtype)).sum().backward()
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == (2, lq, 3, 8)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **CUDA_TOL[dtype])
    for got, leaf in zip(on, leaves):
        torch.testing.assert_close(got.grad.double().cpu(), leaf.grad, **CUDA_TOL[dtype])

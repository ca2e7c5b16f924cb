"""The shared attention kernel (fused CPU attention with LSE, and the blockwise one) vs naive.

Single process: position runs and causal pieces (they cover exactly the visible pairs), one
block's forward and backward against plain softmax attention for contiguous, offset, zigzag and
uneven position sets, GQA, a value head size different from the query's, fp64/fp32/bf16; the
FlashAttention-2 split (blocks merged by LSE, backward per block from the final out/lse) equals
the whole; and the kernel choice (argument, environment variable, clear errors).

The kernel tests run on the CPU and, where CUDA is available, again on the GPU (the fused
kernel there is PyTorch's memory-efficient CUDA attention in float32 and its FlashAttention-2 in
half precision; float64 is CPU-only for both, so the CUDA cases run in float32 and half
precision against the same float64 reference, each half-precision kernel forced in turn).
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_marks import CUDA, DEVICES

from dspzoo.core.parallel.methods.kernels import (
    CUDA_BACKEND_ENV,
    KERNEL_ENV,
    BlockwiseKernel,
    FusedKernel,
    LseAccumulator,
    Piece,
    attention_pieces,
    cuda_refusal,
    kernel_attention,
    position_runs,
    select_kernel,
)
from dspzoo.core.parallel.methods.ring import zigzag_positions


def _exact_dtype(device: str) -> torch.dtype:
    """The most exact dtype both kernels take on ``device``."""
    return torch.float64 if device == "cpu" else torch.float32


def naive(q, k, v, q_pos, k_pos, causal, scale):
    """softmax(Q Kᵀ · scale) V on [B, L, H, D] in fp64, GQA, rows that see nothing give 0."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).nan_to_num(0.0), v.double())


def _tensors(lq, lk, h, hkv, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, lq, h, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, lk, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, lk, hkv, dv, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(2, lq, h, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, w


def _cat(*ranges):
    return torch.cat([torch.arange(a, b) for a, b in ranges])


# (q positions, k positions): contiguous, offset both ways, zigzag against zigzag, uneven and
# broken runs, keys wholly in the future, a one-token block
POSITIONS = {
    "same": (torch.arange(7), torch.arange(7)),
    "q_after_k": (torch.arange(5, 11), torch.arange(0, 9)),
    "k_after_q": (torch.arange(0, 6), torch.arange(3, 12)),
    "future": (torch.arange(0, 4), torch.arange(4, 9)),
    "zigzag": (zigzag_positions(13, 3, 0), zigzag_positions(13, 3, 1)),
    "zigzag_self": (zigzag_positions(13, 3, 2), zigzag_positions(13, 3, 2)),
    "broken": (_cat((2, 5), (9, 10), (12, 16)), _cat((0, 3), (4, 13))),
    "one": (torch.tensor([6]), torch.arange(3, 10)),
}


def _visible(q_pos, k_pos, causal):
    if not causal:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.int64)
    return (k_pos[None, :] <= q_pos[:, None]).long()


@pytest.mark.parametrize("name", sorted(POSITIONS))
@pytest.mark.parametrize("causal", [False, True])
def test_pieces_cover_exactly_the_visible_pairs(name, causal):
    q_pos, k_pos = POSITIONS[name]
    runs = position_runs(q_pos)
    assert torch.equal(torch.cat([torch.arange(r.start, r.end) for r in runs]), q_pos)
    count = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
    for p in attention_pieces(runs, position_runs(k_pos), causal):
        qp, kp = q_pos[p.q0 : p.q1], k_pos[p.k0 : p.k1]
        if p.causal:  # square, on the same positions: top-left and bottom-right masks agree
            assert torch.equal(qp, kp)
            count[p.q0 : p.q1, p.k0 : p.k1] += torch.ones(len(qp), len(kp)).tril().long()
        else:
            assert (kp[None, :] <= qp[:, None]).all() or not causal
            count[p.q0 : p.q1, p.k0 : p.k1] += 1
    assert torch.equal(count, _visible(q_pos, k_pos, causal)), name


def test_full_pieces_are_joined_into_one_call():
    """A zigzag shard's later run sees both runs of an earlier rank's block: one full call."""
    # positions [0, 1, 14, 15] and [2, 3, 12, 13]
    q_pos, k_pos = zigzag_positions(16, 4, 0), zigzag_positions(16, 4, 1)
    q_runs, k_runs = position_runs(q_pos), position_runs(k_pos)
    assert attention_pieces(q_runs, k_runs, True) == [Piece(2, 4, 0, 4, False)]
    assert attention_pieces(q_runs, k_runs, False) == [Piece(0, 4, 0, 4, False)]
    own = attention_pieces(q_runs, q_runs, True)  # diagonals stay apart from the full piece
    assert own == [Piece(2, 4, 0, 2, False), Piece(0, 2, 0, 2, True), Piece(2, 4, 2, 4, True)]


def test_position_runs():
    assert position_runs(torch.arange(0)) == []
    runs = position_runs(_cat((4, 7), (1, 3), (3, 4), (9, 10)))  # 1, 2 then 3: one run
    assert [(r.local, r.start, r.length) for r in runs] == [(0, 4, 3), (3, 1, 3), (6, 9, 1)]


TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
}


def _block(kernel, q, k, v, w, q_pos, k_pos, causal, scale):
    """One block through ``kernel``: (out, lse, dq, dk, dv) from its own final out/lse."""
    acc = LseAccumulator(q.shape[0], q.shape[1], q.shape[2], v.shape[-1], q.dtype, q.device)
    kernel.forward(acc, q, k, v, q_pos, k_pos, causal, scale)
    out = acc.out.to(q.dtype)
    grads = tuple(torch.zeros(t.shape, dtype=acc.dtype, device=t.device) for t in (q, k, v))
    kernel.backward(grads, q, k, v, out, acc.lse, w, q_pos, k_pos, causal, scale)
    return (out, acc.lse, *grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(POSITIONS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4, 8, 8), (4, 2, 8, 6), (3, 1, 4, 5)])
def test_one_block_matches_naive_both_kernels(name, causal, heads, device):
    h, hkv, d, dv = heads
    dtype = _exact_dtype(device)
    q_pos, k_pos = POSITIONS[name]
    q, k, v, w = _tensors(len(q_pos), len(k_pos), h, hkv, d, dv, torch.float64)
    scale = 0.37
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*leaves, q_pos, k_pos, causal, scale)
    (ref * w).sum().backward()
    sees = _visible(q_pos, k_pos, causal).any(dim=1)
    on = [t.to(device, dtype) for t in (q, k, v, w)]
    assert FusedKernel.supports(on[0])  # the fused path really runs on this device
    for kernel in (FusedKernel(), BlockwiseKernel()):
        out, lse, dq, dk, dv_ = (t.cpu() for t in _block(kernel, *on, q_pos, k_pos, causal, scale))
        what = f"{kernel.name} {name} causal={causal} heads={heads} on {device}"
        assert not any(t.isnan().any() for t in (out, dq, dk, dv_)), what
        torch.testing.assert_close(out.double(), ref.detach(), **TOL[dtype], msg=what)
        assert torch.isneginf(lse[:, :, ~sees]).all(), what  # rows that see no key
        for got, leaf in zip((dq, dk, dv_), leaves):
            torch.testing.assert_close(got.double(), leaf.grad, **TOL[dtype], msg=what)


@pytest.mark.parametrize(
    ("dtype", "device"),
    [(t, "cpu") for t in (torch.float32, torch.bfloat16, torch.float16)]
    + [pytest.param(t, "cuda", marks=CUDA) for t in (torch.float32, torch.bfloat16, torch.float16)],
)
def test_fused_block_low_precision(dtype, device):
    q_pos, k_pos = POSITIONS["zigzag"]
    q, k, v, w = _tensors(len(q_pos), len(k_pos), 4, 2, 8, 8, dtype)
    ref = _block(
        BlockwiseKernel(), q.double(), k.double(), v.double(), w.double(), q_pos, k_pos, True, 0.5
    )
    assert FusedKernel.supports(q.to(device))
    got = _block(FusedKernel(), *(t.to(device) for t in (q, k, v, w)), q_pos, k_pos, True, 0.5)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(t.device.type == device for t in got)
    for g, r in zip(got, ref):
        finite = ~torch.isinf(r)
        torch.testing.assert_close(g.cpu().double()[finite], r[finite], **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_merged_by_lse_equal_one_call_and_backward_splits(device):
    """Keys cut into uneven blocks (the ring's view): merged forward and per-block backward
    from the final out/lse equal one whole call, for both kernels."""
    lq, lk = 9, 14
    q_pos, k_pos = torch.arange(5, 5 + lq), torch.arange(lk)
    q, k, v, w = _tensors(lq, lk, 4, 2, 8, 8, torch.float64, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*leaves, q_pos, k_pos, True, 0.4)
    (ref * w).sum().backward()
    dtype = _exact_dtype(device)
    q, k, v, w = (t.to(device, dtype) for t in (q, k, v, w))
    cuts = [(0, 3), (3, 4), (4, 10), (10, 14)]
    for kernel in (FusedKernel(), BlockwiseKernel()):
        acc = LseAccumulator(2, lq, 4, 8, q.dtype, q.device)
        for a, b in cuts:
            kernel.forward(acc, q, k[:, a:b], v[:, a:b], q_pos, k_pos[a:b], True, 0.4)
        torch.testing.assert_close(acc.out.cpu().double(), ref.detach(), **TOL[dtype])
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc.dtype, device=device) for t in (q, k, v))
        for a, b in cuts:
            kernel.backward(
                (dq, dk[:, a:b], dv[:, a:b]),
                q,
                k[:, a:b],
                v[:, a:b],
                acc.out,
                acc.lse,
                w,
                q_pos,
                k_pos[a:b],
                True,
                0.4,
            )
        for got, leaf in zip((dq, dk, dv), leaves):
            torch.testing.assert_close(got.cpu().double(), leaf.grad, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["fused", "blockwise"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_attention_autograd(kernel, causal, device):
    q_pos, k_pos = zigzag_positions(17, 2, 1), torch.arange(17)
    q, k, v, w = _tensors(len(q_pos), 17, 6, 3, 4, 4, torch.float64, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*leaves, q_pos, k_pos, causal, 0.5)
    (ref * w).sum().backward()
    dtype = _exact_dtype(device)
    mine = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    out = kernel_attention(*mine, q_pos, k_pos, causal, 0.5, kernel=kernel, chunk=4)
    (out * w.to(device, dtype)).sum().backward()
    assert out.device.type == device
    torch.testing.assert_close(out.cpu().double(), ref, **TOL[dtype])
    for got, leaf in zip(mine, leaves):
        torch.testing.assert_close(got.grad.cpu().double(), leaf.grad, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_kernel_keeps_no_score_matrix(device):
    """What autograd saves is q, k, v, out and lse: O(L·D), not the L × L scores; on CUDA the
    allocator's peak over forward and backward stays far below one score matrix too."""
    from dspzoo.core.parallel.trace import SavedTensorMeter

    length = 512 if device == "cpu" else 8192
    q, k, v = (torch.randn(1, length, 2, 8, device=device, requires_grad=True) for _ in range(3))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with SavedTensorMeter() as meter:
        out = kernel_attention(
            q, k, v, torch.arange(length), torch.arange(length), True, 0.3, kernel="fused"
        )
    assert meter.bytes == 4 * (4 * q.numel() + 2 * length)
    out.sum().backward()
    if device == "cuda":
        scores = 2 * length * length * 4  # one fp32 score matrix per head
        assert torch.cuda.max_memory_allocated() - base < scores / 8


def test_kernel_choice(monkeypatch):
    q = torch.zeros(1, 2, 1, 4)
    assert select_kernel(q).name == "fused"
    assert select_kernel(q, "blockwise").name == "blockwise"
    assert select_kernel(q.to(torch.int64), "fused").name == "blockwise"  # a dtype it lacks
    monkeypatch.setenv(KERNEL_ENV, "blockwise")
    assert select_kernel(q).name == "blockwise"
    assert select_kernel(q, "fused").name == "fused"  # the argument wins
    monkeypatch.setenv(KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match=r"\$DSPZOO_ATTENTION_KERNEL must be one of"):
        select_kernel(q)
    with pytest.raises(ValueError, match="kernel must be one of"):
        select_kernel(q, "triton")


@CUDA
def test_kernel_choice_on_cuda():
    q = torch.zeros(1, 2, 1, 8, device="cuda")
    assert select_kernel(q).name == "fused"
    assert select_kernel(q.half()).name == "fused"
    assert select_kernel(q.bfloat16()).name == "fused"
    assert select_kernel(q.double()).name == "blockwise"  # the CUDA fused kernel has no float64


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blockwise_on_cuda(dtype):
    """The blockwise kernel (``kernel="blockwise"``) in half precision on CUDA is exact to the
    dtype's rounding, forward and backward."""
    q_pos, k_pos = POSITIONS["zigzag"]
    q, k, v, w = _tensors(len(q_pos), len(k_pos), 4, 2, 8, 8, dtype)
    ref = _block(
        BlockwiseKernel(), q.double(), k.double(), v.double(), w.double(), q_pos, k_pos, True, 0.5
    )
    got = _block(BlockwiseKernel(), *(t.to("cuda") for t in (q, k, v, w)), q_pos, k_pos, True, 0.5)
    for g, r in zip(got, ref):
        finite = ~torch.isinf(r)
        torch.testing.assert_close(g.cpu().double()[finite], r[finite], **TOL[dtype])


@CUDA
@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize(
    ("dtype", "backend"),
    [(torch.float32, "auto")]
    + [(t, b) for t in (torch.bfloat16, torch.float16) for b in ("cudnn", "flash", "efficient")],
)
def test_fused_on_cuda_at_ring_sizes(head_dim, dtype, backend):
    """Blocks the size a ring step or an LSS block has (zigzag shards of 1,000 tokens over 4
    ranks, several tiles of the kernel, GQA 8/2 heads, head sizes the kernel specialises and
    one it pads), through each CUDA kernel: forward and every gradient against the blockwise
    kernel in float64."""
    for rank in (0, 3):
        q_pos, k_pos = zigzag_positions(1000, 4, rank), zigzag_positions(1000, 4, 1)
        q, k, v, w = _tensors(len(q_pos), len(k_pos), 8, 2, head_dim, head_dim, torch.float64)
        ref = _block(BlockwiseKernel(), q, k, v, w, q_pos, k_pos, True, head_dim**-0.5)
        on = [t.to("cuda", dtype) for t in (q, k, v, w)]
        assert FusedKernel.supports(on[0])
        _skip_unless_taken(backend, on[0], head_dim)
        got = _block(FusedKernel(backend), *on, q_pos, k_pos, True, head_dim**-0.5)
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            finite = ~torch.isinf(r)
            err = (g.cpu().double()[finite] - r[finite]).norm() / r[finite].norm()
            limit = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[dtype]
            assert err < limit, f"{name} rank {rank} D {head_dim} {dtype}: {err:.1e}"


def _skip_unless_taken(backend: str, q: torch.Tensor, width: int) -> None:
    """Skip a forced CUDA kernel this GPU or build does not take (cuDNN before Hopper)."""
    refusal = cuda_refusal(backend, q, width)
    if refusal is not None:
        pytest.skip(f"{backend} needs {refusal}")


@CUDA
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_half_precision_cuda_backends_match_naive(name, causal, dtype, backend):
    """Each CUDA kernel in half precision on every position set (offset, broken and one-token
    blocks: pieces of every shape), GQA and a value head size it pads: forward and gradients
    against the blockwise kernel in float64, to the dtype's rounding."""
    q_pos, k_pos = POSITIONS[name]
    q, k, v, w = _tensors(len(q_pos), len(k_pos), 4, 2, 8, 6, torch.float64)
    _skip_unless_taken(backend, q.to("cuda", dtype), 8)
    ref = _block(BlockwiseKernel(), q, k, v, w, q_pos, k_pos, causal, 0.5)
    got = _block(
        FusedKernel(backend),
        *(t.to("cuda", dtype) for t in (q, k, v, w)),
        q_pos,
        k_pos,
        causal,
        0.5,
    )
    for what, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        finite = ~torch.isinf(r)
        torch.testing.assert_close(
            g.cpu().double()[finite], r[finite], **TOL[dtype], msg=f"{what} {name} {backend}"
        )


def test_cuda_backend_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="cuda_backend must be one of"):
        FusedKernel("triton")
    monkeypatch.setenv(CUDA_BACKEND_ENV, "flash")
    assert FusedKernel().cuda_backend == "flash" and FusedKernel("auto").cuda_backend == "auto"
    monkeypatch.setenv(CUDA_BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$DSPZOO_CUDA_ATTENTION must be one of"):
        FusedKernel()
    q = torch.zeros(1, 2, 1, 8)
    assert FusedKernel("cudnn").cuda_kernel(q, 8) == "cpu"  # the CPU has one fused kernel
    assert cuda_refusal("efficient", q, 8) is None
    assert "float16 or bfloat16" in cuda_refusal("flash", q, 8)


@CUDA
def test_cuda_backend_choice(monkeypatch):
    """``auto`` runs FlashAttention-2 on half precision (cuDNN only when asked for), the
    memory-efficient kernel on float32 or heads over 256 and wherever PyTorch's own switch
    turns FlashAttention-2 off; a forced kernel refuses what it does not take, naming why."""
    from dspzoo.core.parallel.methods import kernels

    seen = []
    real = kernels._fused_piece
    monkeypatch.setattr(kernels, "_fused_piece", lambda *a: seen.append(a[-1]) or real(*a))
    pos = torch.arange(4)
    cases = [
        (torch.bfloat16, 64, "flash"),
        (torch.float16, 200, "flash"),
        (torch.float32, 64, "efficient"),
        (torch.float16, 264, "efficient"),
    ]
    for dtype, head, want in cases:
        x = torch.randn(1, 4, 2, head, device="cuda").to(dtype)
        kernel_attention(x, x, x, pos, pos, True, 0.1, kernel=FusedKernel())
        assert seen[-1] == want, (dtype, head)
    x = torch.randn(1, 4, 2, 64, device="cuda").bfloat16()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        kernel_attention(x, x, x, pos, pos, True, 0.1, kernel=FusedKernel())
    assert seen[-1] == "efficient"  # PyTorch's switches are honoured
    with pytest.raises(ValueError, match=r"cuda_backend='flash' needs float16 or bfloat16"):
        kernel_attention(
            x.float(), x.float(), x.float(), pos, pos, True, 0.1, kernel=FusedKernel("flash")
        )


def test_cuda_refusals_name_the_reason(monkeypatch):
    """Which CUDA kernel takes what (the checks alone, with the device's capability faked):
    half precision, PyTorch's switch on, the capability and the head size of each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dspzoo.core.parallel.methods import kernels

    monkeypatch.setattr(kernels, "_cuda_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(torch.version, "hip", None)
    half = torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16)
    built = torch.backends.cuda
    monkeypatch.setattr(built, "is_flash_attention_available", lambda: False, raising=False)
    assert "a torch built with FlashAttention-2" in cuda_refusal("flash", half, 64)
    monkeypatch.setattr(built, "is_flash_attention_available", lambda: True, raising=False)
    assert cuda_refusal("flash", half, 256) is None
    assert cuda_refusal("flash", half, 264) == (
        "a head size of at most 256 on compute capability (8, 0) (got 264)"
    )
    assert cuda_refusal("cudnn", half, 64) == "compute capability (9, 0) or newer (got (8, 0))"
    monkeypatch.setattr(kernels, "_cuda_capability", lambda device: (9, 0))
    assert cuda_refusal("cudnn", half, 128) is None
    assert "a head size of at most 128" in cuda_refusal("cudnn", half, 136)
    monkeypatch.setattr(kernels, "_cuda_capability", lambda device: (8, 9))  # an RTX 40xx
    assert cuda_refusal("flash", half, 192) is None
    assert "a head size of at most 192" in cuda_refusal("flash", half, 200)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8902)
    assert cuda_refusal("cudnn", half, 64) == "cuDNN 9 or newer (got 8902)"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert "flash_sdp_enabled() (it is off)" in cuda_refusal("flash", half, 64)
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert "ROCm" in cuda_refusal("flash", half, 64)
    assert cuda_refusal("efficient", half.float(), 512) is None

"""The attention kernel every blockwise method shares: ring, ring_zigzag, USP's ring part, LSS.

A method sees attention as *blocks*: this rank's queries against one block of keys (a ring
step, or LSS's gathered keys), each with the global positions of its tokens. A kernel
accumulates such blocks into a running ``(out, lse)`` (:class:`LseAccumulator`) and, in
backward, adds each block's share of ``dq, dk, dv`` given the *final* ``out``/``lse`` of the
query rows (FlashAttention-2's recomputation; see :mod:`.blockwise`). Two kernels implement
that interface:

* ``"fused"`` (default): PyTorch's fused attention that returns and takes the log-sum-exp and
  never materialises a score matrix (internal tiles only): on the CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``. On CUDA, in
  float16/bfloat16, PyTorch's FlashAttention-2 ``aten._scaled_dot_product_flash_attention``
  (compute capability 8.0+, heads up to 256); in float32, or where it does not take the
  tensors, the memory-efficient kernel ``aten._scaled_dot_product_efficient_attention``; each
  with its ``_backward``. cuDNN's ``aten._scaled_dot_product_cudnn_attention`` (9.0+, heads up
  to 128: what SDPA itself picks on Hopper) is there to opt in to (:data:`AUTO_CUDA_ORDER`);
  :class:`FusedKernel`'s ``cuda_backend``, or ``$DSPZOO_CUDA_ATTENTION``, forces one. A block
  is cut into *pieces* by position runs (:func:`position_runs`), and each piece is exact under
  the causal mask: keys wholly before the queries are one fully visible call; the keys from
  the first common position on form a *square* diagonal piece whose queries and keys start at
  the same position, where SDPA's top-left ``is_causal`` and the bottom-right one of
  FlashAttention-2 (and cuDNN) agree (queries past its last key see all of its keys: a full
  piece); keys wholly after every query are skipped. Grouped-query K/V are expanded to the
  query heads per piece (and their gradients summed back); a value head size different from
  the query's is zero-padded (on CUDA also up to a multiple of 8, the kernel's alignment).
* ``"blockwise"``: the einsum kernel of :mod:`.blockwise` (one ``Lq × Lk`` score block per
  call, float32/float64 statistics); kept for comparison and for tensors the fused kernel does
  not take (float64 on CUDA, other devices, dtypes it lacks).

The kernel is chosen by the ``kernel`` argument of the methods or, when that is ``None``, by
the environment variable ``DSPZOO_ATTENTION_KERNEL`` (``fused`` or ``blockwise``). Both are
exact; the choice changes speed and memory, never results beyond rounding, and never bytes.

Memory: the fused kernel keeps O(``Lq + Lk``) per block (inputs, output, gradients, and the
statistics), so a ring rank holds O(L/N) and LSS O(L) (its gathered keys) at any length.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .blockwise import (
    attention_delta,
    block_attention,
    block_attention_backward,
    merge,
    stats_dtype,
)

__all__ = [
    "KERNELS",
    "KERNEL_ENV",
    "CUDA_BACKENDS",
    "CUDA_BACKEND_ENV",
    "BlockwiseKernel",
    "FusedKernel",
    "LseAccumulator",
    "Piece",
    "Run",
    "add_block",
    "add_block_grads",
    "attention_pieces",
    "cuda_refusal",
    "join_full_pieces",
    "kernel_attention",
    "position_runs",
    "select_kernel",
]

KERNELS = ("fused", "blockwise")
KERNEL_ENV = "DSPZOO_ATTENTION_KERNEL"
_FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}
_CUDA_ALIGN = 8  # the memory-efficient CUDA kernel's head-size alignment (elements)
_LSE_ALIGN = 32  # the length its forward pads the log-sum-exp rows to


# -- positions: runs and pieces -----------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Rows ``[local, local + length)`` of a block hold positions ``[start, start + length)``."""

    local: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def position_runs(pos: torch.Tensor) -> list[Run]:
    """Cut int64 positions ``[L]`` into maximal runs of consecutive positions, in row order.

    A contiguous shard is one run, a zigzag shard two (one if its chunks touch).
    """
    pos = pos.detach().cpu()
    if pos.numel() == 0:
        return []
    breaks = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, pos.numel()]
    return [Run(a, int(pos[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class Piece:
    """One kernel call: query rows ``[q0, q1)`` on key rows ``[k0, k1)`` of a block; ``causal``:
    the two are the same positions (a square piece) and the mask is the lower triangle."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def attention_pieces(q_runs: list[Run], k_runs: list[Run], causal: bool) -> list[Piece]:
    """The exact pieces of one block (module doc): fully visible, diagonal, or skipped.

    Non-causal: one piece per pair of runs. Causal, for query run ``[qs, qe)`` and key run
    ``[ks, ke)``: keys ``[ks, min(ke, qs))`` are seen by every query (a full piece); keys
    ``[c, e)`` with ``c = max(ks, qs)``, ``e = min(ke, qe)`` are seen by queries ``[c, e)``
    under the causal mask (a square diagonal piece) and by queries ``[e, qe)`` entirely (a
    full piece); later keys are seen by none. Full pieces that tile a rectangle are joined
    into one call (:func:`join_full_pieces`): a zigzag shard's later run sees both runs of an
    earlier block.
    """
    pieces = []
    for qr in q_runs:
        for kr in k_runs:
            if not causal:
                pieces.append(
                    Piece(qr.local, qr.local + qr.length, kr.local, kr.local + kr.length, False)
                )
                continue
            full_end = min(kr.end, qr.start)
            if full_end > kr.start:
                pieces.append(
                    Piece(
                        qr.local,
                        qr.local + qr.length,
                        kr.local,
                        kr.local + full_end - kr.start,
                        False,
                    )
                )
            c, k_end = max(kr.start, qr.start), min(kr.end, qr.end)
            if k_end > c:
                q0, k0 = qr.local + c - qr.start, kr.local + c - kr.start
                side = k_end - c
                pieces.append(Piece(q0, q0 + side, k0, k0 + side, True))
                if qr.end > k_end:  # queries past the diagonal's last key see all of its keys
                    pieces.append(Piece(q0 + side, qr.local + qr.length, k0, k0 + side, False))
    return join_full_pieces(pieces)


def join_full_pieces(pieces: list[Piece]) -> list[Piece]:
    """Join fully visible pieces on the same query rows with adjacent key rows, then those on
    the same key rows with adjacent query rows (every pair of a union of fully visible pieces
    is visible); diagonal pieces are kept as they are, after the full ones."""
    full = [p for p in pieces if not p.causal]
    for along_keys in (True, False):
        joined: list[Piece] = []
        order = (lambda p: (p.q0, p.q1, p.k0)) if along_keys else (lambda p: (p.k0, p.k1, p.q0))
        for p in sorted(full, key=order):
            last = joined[-1] if joined else None
            if last and along_keys and (last.q0, last.q1) == (p.q0, p.q1) and last.k1 == p.k0:
                joined[-1] = Piece(p.q0, p.q1, last.k0, p.k1, False)
            elif last and not along_keys and (last.k0, last.k1) == (p.k0, p.k1) and last.q1 == p.q0:
                joined[-1] = Piece(last.q0, p.q1, p.k0, p.k1, False)
            else:
                joined.append(p)
        full = joined
    return full + [p for p in pieces if p.causal]


# -- the running result -------------------------------------------------------------------------
class LseAccumulator:
    """A running ``out [Bf, Lq, H, Dv]`` and ``lse [Bf, H, Lq]`` in the statistics dtype, merged
    row range by row range (rows no block reached keep ``out = 0``, ``lse = -inf``)."""

    def __init__(
        self, bf: int, lq: int, heads: int, dv: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.dtype = stats_dtype(dtype)
        self.out = torch.zeros((bf, lq, heads, dv), dtype=self.dtype, device=device)
        self.lse = torch.full((bf, heads, lq), -math.inf, dtype=self.dtype, device=device)
        self.touched = torch.zeros(lq, dtype=torch.bool)  # rows that hold a result (CPU)

    def rows(self, q0: int, q1: int) -> LseAccumulator:
        """The accumulator of rows ``[q0, q1)``: views of this one's storage (merging into it
        merges into these rows here)."""
        view = object.__new__(LseAccumulator)
        view.dtype = self.dtype
        view.out, view.lse = self.out[:, q0:q1], self.lse[:, :, q0:q1]
        view.touched = self.touched[q0:q1]
        return view

    def add(self, q0: int, q1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a partial result over a disjoint key set into rows ``[q0, q1)``."""
        if q1 <= q0:
            return
        if not bool(self.touched[q0:q1].any()):  # first result for these rows: take it
            self.out[:, q0:q1] = out
            self.lse[:, :, q0:q1] = lse
        else:
            o, s = merge(self.out[:, q0:q1], self.lse[:, :, q0:q1], out, lse)
            self.out[:, q0:q1] = o
            self.lse[:, :, q0:q1] = s
        self.touched[q0:q1] = True


# -- kernels ------------------------------------------------------------------------------------
class BlockwiseKernel:
    """The einsum kernel of :mod:`.blockwise`: one score block per call."""

    name = "blockwise"

    def forward(
        self,
        acc: LseAccumulator,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> None:
        """Merge ``q [Bf, Lq, H, D]`` on the key block ``k, v [Bf, Lk, Hkv, D]`` into ``acc``."""
        o, lse = block_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            q_pos=q_pos.to(q.device),
            k_pos=k_pos.to(q.device),
        )
        acc.add(0, q.shape[1], o, lse)

    def backward(
        self,
        grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> None:
        """Add the key block's share of ``dq`` and its ``dk, dv`` into ``grads`` (statistics
        dtype accumulators shaped like q, k, v), from the final ``out``/``lse``."""
        dq, dk, dv = block_attention_backward(
            q,
            k,
            v,
            out,
            lse,
            dout,
            scale=scale,
            causal=causal,
            q_pos=q_pos.to(q.device),
            k_pos=k_pos.to(q.device),
            delta=attention_delta(out, dout),
        )
        grads[0].add_(dq)
        grads[1].add_(dk)
        grads[2].add_(dv)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[Bf, L, Hkv, D]`` → ``[Bf, L, H, D]``: KV head ``h // g`` serves query head ``h``."""
    g = heads // t.shape[2]
    if g == 1:
        return t
    bf, length, hkv, d = t.shape
    return t[:, :, :, None].expand(bf, length, hkv, g, d).reshape(bf, length, heads, d)


def _sum_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`_expand_heads` for gradients: sum each KV head's ``g`` query heads."""
    bf, length, heads, d = t.shape
    if heads == kv_heads:
        return t
    return t.view(bf, length, kv_heads, heads // kv_heads, d).sum(dim=3)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _bhld(t: torch.Tensor) -> torch.Tensor:
    """``[Bf, L, H, D]`` → the ``[Bf, H, L, D]`` view the aten kernel takes (no copy)."""
    return t.transpose(1, 2)


#: the CUDA kernels of the fused path (module doc)
CUDA_BACKENDS = ("auto", "cudnn", "flash", "efficient")
#: what ``auto`` tries, in order. cuDNN's kernel is not among them yet: on an H200 it ran the
#: raw forward + backward in 2.25 ms against FlashAttention-2's 3.65 (bf16, L 16384) and took
#: the final out/lse of a split key set exactly, but it has not run this module's CUDA tests
#: (every piece shape, tiny and odd blocks); opt in with ``cuda_backend="cudnn"`` or
#: ``$DSPZOO_CUDA_ATTENTION=cudnn`` (docs/gpu.md)
AUTO_CUDA_ORDER = ("flash", "efficient")
#: the environment variable that picks one when the code does not (default ``auto``)
CUDA_BACKEND_ENV = "DSPZOO_CUDA_ATTENTION"
_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD = {"cudnn": 128, "flash": 256}  # the largest head size each takes
_FLASH_CONSUMER_MAX_HEAD = 192  # FlashAttention-2's backward on sm 8.6, 8.9, 12.x
_MIN_CAPABILITY = {"cudnn": (9, 0), "flash": (8, 0)}  # cuDNN's only where PyTorch prefers it
_ENABLED = {  # PyTorch's own switches for its SDPA backends, which these honour
    "cudnn": "cudnn_sdp_enabled",
    "flash": "flash_sdp_enabled",
}


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per device."""
    return torch.cuda.get_device_capability(index)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def cuda_refusal(backend: str, q: torch.Tensor, width: int) -> str | None:
    """Why CUDA kernel ``backend`` does not take tensors like ``q`` at head size ``width``, or
    ``None`` when it does. ``cudnn`` and ``flash`` need float16/bfloat16, a CUDA (not ROCm)
    build that has the kernel, enabled (``torch.backends.cuda.enable_{cudnn,flash}_sdp``),
    compute capability 9.0 (cuDNN 9 or newer) or 8.0 (FlashAttention-2) and a head of at
    most 128 / 256 (FlashAttention-2's backward: 192 on the consumer chips sm 8.6, 8.9 and
    12.x, as PyTorch's own check says). ``efficient`` takes every dtype the fused path has on
    CUDA; it is the fallback, so its switch (``enable_mem_efficient_sdp``) is not read."""
    if backend == "efficient":
        return None
    if q.dtype not in _HALF:
        return f"float16 or bfloat16 (got {q.dtype})"
    if torch.version.hip is not None:
        return "a CUDA build of torch (this one is ROCm)"
    enabled = getattr(torch.backends.cuda, _ENABLED[backend], None)
    if enabled is None or not enabled():
        return f"torch.backends.cuda.{_ENABLED[backend]}() (it is off)"
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if backend == "flash" and not built():
        return "a torch built with FlashAttention-2 (this one is not)"
    if backend == "cudnn" and (torch.backends.cudnn.version() or 0) < 90000:
        return f"cuDNN 9 or newer (got {torch.backends.cudnn.version()})"
    capability = _cuda_capability(q.device)
    if capability < _MIN_CAPABILITY[backend]:
        return f"compute capability {_MIN_CAPABILITY[backend]} or newer (got {capability})"
    most = _MAX_HEAD[backend]
    if backend == "flash" and (capability in ((8, 6), (8, 9)) or capability[0] == 12):
        most = _FLASH_CONSUMER_MAX_HEAD
    if width > most:
        return f"a head size of at most {most} on compute capability {capability} (got {width})"
    return None


@functools.cache
def _no_dropout(backend: str, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """``cum_seq_q, cum_seq_k, philox_seed, philox_offset`` as the ``flash`` or ``cudnn``
    forward returns them for a dense batch without dropout (what its backward is handed
    back), from one tiny call."""
    tiny = torch.zeros(1, 1, 16, 64, dtype=torch.float16, device=device)
    if backend == "flash":
        result = torch.ops.aten._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, False)
    else:
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            tiny, tiny, tiny, None, True, 0.0, False, False
        )
    return result[2], result[3], result[6], result[7]


def _fused_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, cuda: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call on ``[Bf, H, L, D]`` views → ``out [Bf, H, Lq, D]``, ``lse [Bf, H, Lq]``
    (float32; float64 for float64 on the CPU). ``cuda``: the CUDA kernel (``cudnn``,
    ``flash`` or ``efficient``; the CPU has one)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    if cuda == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse.reshape(out.shape[:3])  # its statistics were [Bf, H, Lq, 1] (torch 2.11)
    if cuda == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]  # some versions pad the statistics' length


def _tokens_before_heads(t: torch.Tensor) -> torch.Tensor:
    """A ``[Bf, H, L, D]`` view whose storage is ``[Bf, L, H, D]``-contiguous, as the queries'
    are. In half precision the memory-efficient CUDA backward computes ``rowsum(dout · out)``
    itself and reads ``out`` with a row stride of ``heads × head size`` whatever its strides
    say (given ``[Bf, H, L, D]``-contiguous ones it returned wrong ``dq``/``dk`` on an H200,
    torch 2.11; docs/gpu.md); ``dout`` is laid out the same way for symmetry. The cuDNN and
    flash backwards are handed the same layout, the one they were checked in on the GPU."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _fused_piece_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    cuda: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` (``[Bf, H, L, D]``) of one fused call, given the *final* ``out`` and
    ``lse`` of its query rows (so the piece's exact share of the whole attention's gradient)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if cuda == "cudnn":
        cum_q, cum_k, seed, offset = _no_dropout("cudnn", q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _tokens_before_heads(dout),
            q,
            k,
            v,
            _tokens_before_heads(out),
            lse.contiguous().unsqueeze(-1),  # read as a dense [Bf, H, Lq, 1]
            seed,
            offset,
            None,
            cum_q,
            cum_k,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            scale=scale,
        )
        return dq, dk, dv
    if cuda == "flash":
        cum_q, cum_k, seed, offset = _no_dropout("flash", q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _tokens_before_heads(dout),
            q,
            k,
            v,
            _tokens_before_heads(out),
            lse.contiguous(),  # read as a dense [Bf, H, Lq]
            cum_q,
            cum_k,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return dq, dk, dv
    no_dropout = torch.empty(0, dtype=torch.int64, device=q.device)  # seed/offset: unread at p=0
    # the kernel reads the statistics with head and batch strides that are multiples of 8; its
    # own forward pads their length to a multiple of 32, which is what this hands it
    rows = lse.shape[-1]
    padded = lse.new_zeros(*lse.shape[:-1], -(-rows // _LSE_ALIGN) * _LSE_ALIGN)
    padded[..., :rows] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _tokens_before_heads(dout),
        q,
        k,
        v,
        None,
        _tokens_before_heads(out),
        padded,
        no_dropout,
        no_dropout,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


class FusedKernel:
    """PyTorch's fused attention with log-sum-exp (CPU or CUDA), one call per exact piece
    (module doc).

    ``cuda_backend``: which CUDA kernel runs (the CPU has one and ignores it): ``"auto"`` (the
    first of :data:`AUTO_CUDA_ORDER`, ``flash`` then ``efficient``, that takes the tensors,
    :func:`cuda_refusal`), or ``cudnn``, ``flash`` or ``efficient``, an error where it does
    not take them. ``None``: ``$DSPZOO_CUDA_ATTENTION``, default ``auto``.
    """

    name = "fused"

    def __init__(self, cuda_backend: str | None = None) -> None:
        chosen = os.environ.get(CUDA_BACKEND_ENV, "auto") if cuda_backend is None else cuda_backend
        if chosen not in CUDA_BACKENDS:
            source = f"${CUDA_BACKEND_ENV}" if cuda_backend is None else "cuda_backend"
            raise ValueError(f"{source} must be one of {CUDA_BACKENDS}, got {chosen!r}")
        self.cuda_backend = chosen

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        """Whether the fused kernel takes tensors like ``q`` (CPU or CUDA, a dtype it has; on
        CUDA bfloat16 needs compute capability 8.0, Ampere, or newer)."""
        if q.dtype not in _FUSED_DTYPES.get(q.device.type, ()):
            return False
        if q.device.type == "cuda" and q.dtype == torch.bfloat16:
            return _cuda_capability(q.device) >= (8, 0)
        return True

    @staticmethod
    def head_width(q: torch.Tensor, v: torch.Tensor) -> int:
        """The common head size the calls run at: ``max(D, Dv)``, aligned on CUDA."""
        width = max(q.shape[-1], v.shape[-1])
        if q.device.type == "cuda":
            width = -(-width // _CUDA_ALIGN) * _CUDA_ALIGN
        return width

    def cuda_kernel(self, q: torch.Tensor, width: int) -> str:
        """The CUDA kernel calls on tensors like ``q`` at head size ``width`` run (``cpu`` on
        the CPU); see the class doc."""
        if q.device.type != "cuda":
            return "cpu"
        if self.cuda_backend == "auto":
            return next(b for b in AUTO_CUDA_ORDER if cuda_refusal(b, q, width) is None)
        refusal = cuda_refusal(self.cuda_backend, q, width)
        if refusal is not None:
            raise ValueError(
                f"cuda_backend={self.cuda_backend!r} needs {refusal} on {q.device}: use "
                "'auto' or 'efficient'"
            )
        return self.cuda_backend

    def forward(
        self,
        acc: LseAccumulator,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> None:
        """As :meth:`BlockwiseKernel.forward`, piece by piece."""
        heads, dv = q.shape[2], v.shape[-1]
        width = self.head_width(q, v)
        cuda = self.cuda_kernel(q, width)
        for p in attention_pieces(position_runs(q_pos), position_runs(k_pos), causal):
            qp = _pad_last(q[:, p.q0 : p.q1], width)
            kp = _pad_last(_expand_heads(k[:, p.k0 : p.k1], heads), width)
            vp = _pad_last(_expand_heads(v[:, p.k0 : p.k1], heads), width)
            o, lse = _fused_piece(_bhld(qp), _bhld(kp), _bhld(vp), p.causal, scale, cuda)
            acc.add(p.q0, p.q1, _bhld(o)[..., :dv], lse)

    def backward(
        self,
        grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> None:
        """As :meth:`BlockwiseKernel.backward`, piece by piece (the kernel's own backward,
        given the final ``out`` and ``lse``, yields exactly the piece's share)."""
        heads, kv_heads, d, dv = q.shape[2], k.shape[2], q.shape[-1], v.shape[-1]
        width = self.head_width(q, v)
        cuda = self.cuda_kernel(q, width)
        lse = lse.to(stats_dtype(q.dtype))
        for p in attention_pieces(position_runs(q_pos), position_runs(k_pos), causal):
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            dq, dk, dvv = _fused_piece_backward(
                _bhld(_pad_last(dout[:, rows].to(q.dtype), width)),
                _bhld(_pad_last(q[:, rows], width)),
                _bhld(_pad_last(_expand_heads(k[:, keys], heads), width)),
                _bhld(_pad_last(_expand_heads(v[:, keys], heads), width)),
                _bhld(_pad_last(out[:, rows].to(q.dtype), width)),
                lse[:, :, rows],
                p.causal,
                scale,
                cuda,
            )
            grads[0][:, rows] += _bhld(dq)[..., :d]
            grads[1][:, keys] += _sum_heads(_bhld(dk)[..., :d].to(grads[1].dtype), kv_heads)
            grads[2][:, keys] += _sum_heads(_bhld(dvv)[..., :dv].to(grads[2].dtype), kv_heads)


def select_kernel(q: torch.Tensor, name: str | None = None) -> BlockwiseKernel | FusedKernel:
    """The kernel called ``name`` (``None``: ``$DSPZOO_ATTENTION_KERNEL``, default ``fused``);
    ``fused`` falls back to ``blockwise`` for tensors it does not take (see the module doc)."""
    chosen = os.environ.get(KERNEL_ENV, "fused") if name is None else name
    if chosen not in KERNELS:
        source = f"${KERNEL_ENV}" if name is None else "kernel"
        raise ValueError(f"{source} must be one of {KERNELS}, got {chosen!r}")
    if chosen == "fused" and FusedKernel.supports(q):
        return FusedKernel()
    return BlockwiseKernel()


# -- one block of keys, tiled for the blockwise kernel -------------------------------------------
def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def visible_any(causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether any query sees any key (CPU positions, no device sync)."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return False
    return not causal or bool(k_pos.min() <= q_pos.max())


def _tiles(
    impl: BlockwiseKernel | FusedKernel,
    lq: int,
    lk: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    chunk: int | None,
) -> list[tuple[int, int, int, int]]:
    """The ``(q0, q1, k0, k1)`` tiles of a block that hold a visible key: the whole block for
    the fused kernel (it tiles internally) or ``chunk is None``, else ``chunk × chunk``."""
    if impl.name == "fused" or chunk is None:
        chunk = max(lq, lk, 1)
    return [
        (q0, q1, k0, k1)
        for q0, q1 in _chunks(lq, chunk)
        for k0, k1 in _chunks(lk, chunk)
        if visible_any(causal, q_pos[q0:q1], k_pos[k0:k1])
    ]


def add_block(
    impl: BlockwiseKernel | FusedKernel,
    acc: LseAccumulator,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
    chunk: int | None = None,
) -> None:
    """Merge the attention of ``q [Bf, Lq, H, D]`` on the key block ``k, v [Bf, Lk, Hkv, D(v)]``
    into ``acc`` (rows ``[0, Lq)``); CPU positions ``q_pos [Lq]``, ``k_pos [Lk]`` in any order.
    ``chunk``: the blockwise kernel's tile (its memory bound); tiles no query sees are skipped."""
    for q0, q1, k0, k1 in _tiles(impl, q.shape[1], k.shape[1], q_pos, k_pos, causal, chunk):
        impl.forward(
            acc.rows(q0, q1),
            q[:, q0:q1],
            k[:, k0:k1],
            v[:, k0:k1],
            q_pos[q0:q1],
            k_pos[k0:k1],
            causal,
            scale,
        )


def add_block_grads(
    impl: BlockwiseKernel | FusedKernel,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
    chunk: int | None = None,
) -> None:
    """Backward of :func:`add_block`: add the key block's share of ``dq`` and its ``dk, dv``
    into ``grads`` (statistics-dtype accumulators shaped like q, k, v; views are fine) from the
    final ``out [Bf, Lq, H, Dv]``, ``lse [Bf, H, Lq]`` and ``dout``."""
    for q0, q1, k0, k1 in _tiles(impl, q.shape[1], k.shape[1], q_pos, k_pos, causal, chunk):
        impl.backward(
            (grads[0][:, q0:q1], grads[1][:, k0:k1], grads[2][:, k0:k1]),
            q[:, q0:q1],
            k[:, k0:k1],
            v[:, k0:k1],
            out[:, q0:q1],
            lse[:, :, q0:q1],
            dout[:, q0:q1],
            q_pos[q0:q1],
            k_pos[k0:k1],
            causal,
            scale,
        )


# -- one process: the whole attention as one autograd function -----------------------------------
def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: str | BlockwiseKernel | FusedKernel | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Exact attention ``[Bf, Lq, H, D]`` × ``[Bf, Lk, Hkv, D(v)]`` → ``[Bf, Lq, H, Dv]`` in q's
    dtype, causal by the int64 positions ``q_pos [Lq]``, ``k_pos [Lk]`` (CPU or any device).

    ``kernel``: a kernel's name (:func:`select_kernel`) or a kernel itself (e.g.
    ``FusedKernel(cuda_backend="efficient")``). Saves only ``q, k, v, out, lse`` for backward,
    which recomputes. ``chunk`` cuts queries and keys into blocks of that many tokens (the
    blockwise kernel's memory bound; the fused kernel needs none, and blocks with no visible
    key are skipped). Once differentiable.
    """
    impl = (
        kernel if isinstance(kernel, (BlockwiseKernel, FusedKernel)) else select_kernel(q, kernel)
    )
    return _KernelAttention.apply(
        q, k, v, q_pos.detach().cpu(), k_pos.detach().cpu(), causal, scale, impl, chunk
    )


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
        impl: BlockwiseKernel | FusedKernel,
        chunk: int | None,
    ) -> torch.Tensor:
        bf, lq, h, _ = q.shape
        acc = LseAccumulator(bf, lq, h, v.shape[-1], q.dtype, q.device)
        add_block(impl, acc, q, k, v, q_pos, k_pos, causal, scale, chunk)
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.pos, ctx.causal, ctx.scale, ctx.impl, ctx.chunk = (
            (q_pos, k_pos),
            causal,
            scale,
            impl,
            chunk,
        )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        q_pos, k_pos = ctx.pos
        dt = stats_dtype(q.dtype)
        grads = tuple(torch.zeros(t.shape, dtype=dt, device=t.device) for t in (q, k, v))
        add_block_grads(
            ctx.impl, grads, q, k, v, out, lse, dout, q_pos, k_pos, ctx.causal, ctx.scale, ctx.chunk
        )
        dq, dk, dv = grads
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 6

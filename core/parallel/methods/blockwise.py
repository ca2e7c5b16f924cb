"""Attention on blocks of keys with log-sum-exp statistics: the pieces of ring / chunked attention.

Layout is ``[Bf, L, H, D]`` (tokens before heads, as :func:`dspzoo.core.layers.attention.attend`);
``Bf`` is any flattened batch. Keys and values may have fewer heads ``Hkv`` dividing ``H``
(grouped-query attention): query head ``h`` reads key/value head ``h // (H // Hkv)``.

Statistics (scores, softmax, log-sum-exp ``lse [Bf, H, Lq]``) are computed in the *statistics
dtype*: float64 for float64 inputs, float32 for everything else (fp32, bf16, fp16). A block's
output is returned in the input dtype by :func:`block_attention`; :func:`merge` and the
backward pieces work and return in the statistics dtype so that running sums stay exact enough.

Causal masking is by *global positions*: with ``q_pos [Lq]`` and ``k_pos [Lk]`` (int64), key
``j`` is visible to query ``i`` iff ``k_pos[j] <= q_pos[i]``. Both default to ``arange`` (so an
unspecified causal mask is the top-left aligned one of SDPA's ``is_causal``). A query row that
sees no key gets ``out = 0`` and ``lse = -inf``; no NaN is produced anywhere, forward or backward.

Backward follows FlashAttention-2: given the *final* ``out``/``lse`` of a query row (merged over
all key blocks) and ``dout``, each key block's contribution is recomputed independently::

    Δ = rowsum(dout ∘ out),  P = exp(S − lse),  dV = Pᵀ dout,  dP = dout Vᵀ,
    dS = P ∘ (dP − Δ),  dQ = dS K · scale,  dK = dSᵀ Q · scale
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "block_attention",
    "block_attention_backward",
    "chunked_attention",
    "merge",
    "stats_dtype",
]


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics for inputs of ``dtype``: float64 stays, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate shapes; return the number of query heads per key/value head."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention blocks are [Bf, L, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in [Bf, Lk, Hkv]")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:  # v's head dim may differ
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    h, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    return h // hkv


def _visible(
    lq: int,
    lk: int,
    causal: bool,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
    batch: int,
    heads: int,
    groups: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean ``[Bf|1, Hkv|1, g|1, Lq, Lk]`` mask (True = attend) or ``None`` when all visible."""
    vis = None
    if causal:
        qp = torch.arange(lq, device=device) if q_pos is None else q_pos.to(device)
        kp = torch.arange(lk, device=device) if k_pos is None else k_pos.to(device)
        if qp.shape != (lq,) or kp.shape != (lk,):
            raise ValueError(
                f"positions must be [Lq]={lq} and [Lk]={lk}; got {tuple(qp.shape)}, {tuple(kp.shape)}"
            )
        vis = (kp[None, :] <= qp[:, None]).view(1, 1, 1, lq, lk)
    if mask is not None:
        m = torch.broadcast_to(mask.to(device=device, dtype=torch.bool), (batch, heads, lq, lk))
        m = m.reshape(batch, heads // groups, groups, lq, lk)
        vis = m if vis is None else vis & m
    return vis


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, groups: int, dtype: torch.dtype
) -> torch.Tensor:
    """``S = Q Kᵀ · scale`` as ``[Bf, Hkv, g, Lq, Lk]`` in the statistics dtype."""
    bf, lq, h, d = q.shape
    qg = q.to(dtype).reshape(bf, lq, h // groups, groups, d)
    return torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(dtype)) * scale


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of a query block on one key block, with its log-sum-exp.

    ``q [Bf, Lq, H, D]``, ``k``/``v [Bf, Lk, Hkv, D]`` → ``(out [Bf, Lq, H, D]`` in q's dtype,
    ``lse [Bf, H, Lq]`` in the statistics dtype). ``mask`` (bool, True = attend) broadcasts to
    ``[Bf, H, Lq, Lk]`` and combines with the causal mask. Differentiable with plain autograd
    (the ring and chunked paths use :func:`block_attention_backward` instead).
    """
    groups = _check(q, k, v)
    bf, lq, h, d = q.shape
    lk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dt = stats_dtype(q.dtype)
    vis = _visible(lq, lk, causal, q_pos, k_pos, mask, bf, h, groups, q.device)
    s = _scores(q, k, scale, groups, dt)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    # the row maximum only stabilises exp; lse does not depend on it, so no gradient through it
    m = s.detach().amax(dim=-1, keepdim=True) if lk else s.new_full((*s.shape[:-1], 1), -math.inf)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    empty = denom == 0  # rows that see no key: lse = -inf, out = 0, zero gradients
    denom = torch.where(empty, torch.ones_like(denom), denom)
    lse = torch.where(empty, -math.inf, m + torch.log(denom)).squeeze(-1)
    p = p / denom
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(dt)).reshape(bf, lq, h, v.shape[-1])
    return out.to(q.dtype), lse.reshape(bf, h, lq)


def _weights(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_part − lse)`` as ``[Bf, Lq, H, 1]``, 0 where either is -inf."""
    w = torch.exp(lse_part - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    w = torch.where(torch.isneginf(lse_part), torch.zeros_like(w), w)
    return w.transpose(1, 2).unsqueeze(-1)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets.

    ``out_* [Bf, Lq, H, D]``, ``lse_* [Bf, H, Lq]`` → ``(out, lse)`` over the union of the keys,
    both in the statistics dtype (``lse``'s, at least float32). Rows where both sides are
    ``-inf`` stay ``out = 0``, ``lse = -inf``; differentiable and NaN-free.
    """
    dt = torch.promote_types(lse_a.dtype, lse_b.dtype)
    lse_a, lse_b = lse_a.to(dt), lse_b.to(dt)
    hi = torch.maximum(lse_a, lse_b)
    hi_safe = torch.where(torch.isinf(hi), torch.zeros_like(hi), hi)
    total = torch.exp(lse_a - hi_safe) + torch.exp(lse_b - hi_safe)
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, -math.inf, hi_safe + torch.log(total))
    out = out_a.to(dt) * _weights(lse_a, lse) + out_b.to(dt) * _weights(lse_b, lse)
    return out, lse


def block_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key block's share of an attention whose final result is ``out``/``lse``.

    ``out [Bf, Lq, H, D]`` and ``lse [Bf, H, Lq]`` are the final values over *all* key blocks,
    ``dout`` the gradient of ``out``. Returns ``(dq [Bf, Lq, H, D], dk, dv [Bf, Lk, Hkv, D])`` in
    the statistics dtype: sum ``dq`` over key blocks and ``dk``/``dv`` over query blocks.
    ``delta = rowsum(dout ∘ out)`` as ``[Bf, H, Lq]`` may be passed to avoid recomputing it
    per block (see :func:`attention_delta`).
    """
    groups = _check(q, k, v)
    bf, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dt = stats_dtype(q.dtype)
    if delta is None:
        delta = attention_delta(out, dout)
    vis = _visible(lq, lk, causal, q_pos, k_pos, mask, bf, h, groups, q.device)
    s = _scores(q, k, scale, groups, dt)
    lse = lse.to(dt).reshape(bf, hkv, groups, lq, 1)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)  # P = 0 there
    p = torch.exp(s - lse)
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    do = dout.to(dt).reshape(bf, lq, hkv, groups, v.shape[-1])
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(dt))
    ds = p * (dp - delta.to(dt).reshape(bf, hkv, groups, lq, 1))
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(dt)).reshape(bf, lq, h, d) * scale
    qg = q.to(dt).reshape(bf, lq, hkv, groups, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg) * scale
    return dq, dk, dv


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``Δ = rowsum(dout ∘ out)`` as ``[Bf, H, Lq]`` in the statistics dtype."""
    dt = stats_dtype(out.dtype)
    return (dout.to(dt) * out.to(dt)).sum(dim=-1).transpose(1, 2)


def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, length - s)) for s in range(0, length, chunk)]


def _skip(causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True when no query of the block sees any key (empty or entirely in the causal future)."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return True
    return causal and bool(k_pos.min() > q_pos.max())


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    scale: float | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Memory-lean exact attention: ``[Bf, Lq, H, D]`` × ``[Bf, Lk, Hkv, D]`` → ``[Bf, Lq, H, D]``.

    Query and key chunks of ``chunk`` tokens are combined with the online-softmax :func:`merge`;
    only ``q, k, v, out, lse`` are saved for backward, which recomputes each block, so memory is
    ``O(chunk²)`` scores per head instead of ``O(Lq·Lk)``. Blocks entirely in the causal future
    are skipped. Positions as in :func:`block_attention` (default ``arange``).
    Once differentiable.
    """
    _check(q, k, v)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    qp = torch.arange(q.shape[1], device=q.device) if q_pos is None else q_pos.to(q.device)
    kp = torch.arange(k.shape[1], device=q.device) if k_pos is None else k_pos.to(q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _ChunkedAttention.apply(q, k, v, qp, kp, bool(causal), scale, int(chunk))


class _ChunkedAttention(torch.autograd.Function):
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
        chunk: int,
    ) -> torch.Tensor:
        bf, lq, h, d = q.shape
        dt = stats_dtype(q.dtype)
        dv = v.shape[-1]
        out = q.new_empty((bf, lq, h, dv))
        lse = torch.full((bf, h, lq), -math.inf, dtype=dt, device=q.device)
        for qs, ql in _chunks(lq, chunk):
            qc, qpc = q[:, qs : qs + ql], q_pos[qs : qs + ql]
            acc = torch.zeros((bf, ql, h, dv), dtype=dt, device=q.device)
            acc_lse = torch.full((bf, h, ql), -math.inf, dtype=dt, device=q.device)
            for ks, kl in _chunks(k.shape[1], chunk):
                kpc = k_pos[ks : ks + kl]
                if _skip(causal, qpc, kpc):
                    continue
                o, s = block_attention(
                    qc,
                    k[:, ks : ks + kl],
                    v[:, ks : ks + kl],
                    scale=scale,
                    causal=causal,
                    q_pos=qpc,
                    k_pos=kpc,
                )
                acc, acc_lse = merge(acc, acc_lse, o, s)
            out[:, qs : qs + ql] = acc.to(q.dtype)
            lse[:, :, qs : qs + ql] = acc_lse
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.causal, ctx.scale, ctx.chunk = causal, scale, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        dt = stats_dtype(q.dtype)
        delta = attention_delta(out, dout)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)
        for qs, ql in _chunks(q.shape[1], ctx.chunk):
            qpc = q_pos[qs : qs + ql]
            for ks, kl in _chunks(k.shape[1], ctx.chunk):
                kpc = k_pos[ks : ks + kl]
                if _skip(ctx.causal, qpc, kpc):
                    continue
                a, b, c = block_attention_backward(
                    q[:, qs : qs + ql],
                    k[:, ks : ks + kl],
                    v[:, ks : ks + kl],
                    out[:, qs : qs + ql],
                    lse[:, :, qs : qs + ql],
                    dout[:, qs : qs + ql],
                    scale=ctx.scale,
                    causal=ctx.causal,
                    q_pos=qpc,
                    k_pos=kpc,
                    delta=delta[:, :, qs : qs + ql],
                )
                dq[:, qs : qs + ql] += a
                dk[:, ks : ks + kl] += b
                dv[:, ks : ks + kl] += c
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 5

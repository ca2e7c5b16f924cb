"""Attention kernels: flash-attn on CUDA half-precision tensors when importable, else SDPA.

:func:`attend` takes ``[N, L, H, D]`` tensors (tokens before heads, flash-attn's layout) and is
the single place where a kernel is chosen, so every strategy and model shares the dispatch.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from ..parallel import context


@lru_cache(maxsize=1)
def flash_attn_func() -> Any | None:
    """``flash_attn.flash_attn_func`` if the package imports, else ``None``."""
    try:
        return importlib.import_module("flash_attn").flash_attn_func
    except Exception:  # not installed, or installed without a usable CUDA build
        return None


def can_use_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """flash-attn handles CUDA fp16/bf16 tensors without an explicit mask, head dim ≤ 256."""
    return (
        mask is None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and flash_attn_func() is not None
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention on ``[N, L, H, D]`` tensors → ``[N, Lq, H, D]``.

    ``mask`` (boolean, True = attend) broadcasts to ``[N, H, Lq, Lk]``. ``causal`` aligns the
    triangle top-left (query ``i`` sees keys ``j <= i``) on every path. ``k``/``v`` may have
    fewer heads than ``q`` (GQA/MQA: ``H % Hkv == 0``). ``scale`` defaults to ``1/√D``.
    """
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads % max(kv_heads, 1):
        raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
    same_length = q.shape[1] == k.shape[1]
    if can_use_flash(q, mask) and (same_length or not causal):
        return flash_attn_func()(q, k, v, dropout_p=dropout_p, causal=causal, softmax_scale=scale)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-2)
        v = v.repeat_interleave(heads // kv_heads, dim=-2)
    if causal and (mask is not None or not same_length):
        # one explicit mask: SDPA versions differ on is_causal with a mask or Lq != Lk
        tri = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        mask = tri if mask is None else (mask & tri)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2)


class SeqSelfAttention(torch.nn.Module):
    """Multi-head self-attention along one named sequence dim of ``[B, *seq, C]``.

    The other sequence dims act as batch dims; the SP context decides what (if anything)
    must be communicated: nothing under DSP, whose plan keeps ``over`` whole. Inside an open
    region (:mod:`dspzoo.core.parallel.context`) ``forward(x)`` reads the runtime and the layout from it;
    ``forward(x, spec, sp)`` passes them explicitly (the earlier API). ``TP_PLAN``
    declares the linears for tensor parallelism (``megatron_sp``): ``qkv`` column-parallel
    with q, k, v stacked (each third sharded by heads), ``proj`` row-parallel; the
    ``sp.tp_enter``/``sp.tp_exit`` hooks around them do nothing under other strategies, and
    the head count is read from ``qkv``'s weight (fewer local heads when it is sharded).
    ``causal=True``: position ``i`` along ``over`` attends to positions ``≤ i`` only (declare
    the stage ``Stage(..., causal=True)`` too, so the planner prices the mask).
    """

    TP_PLAN = {"qkv": ("column", 3), "proj": "row"}

    def __init__(
        self, hidden: int, heads: int, over: str, qkv_bias: bool = True, causal: bool = False
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads, self.head_dim, self.over = heads, hidden // heads, over
        self.causal = causal
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=qkv_bias)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, spec: Any = None, sp: Any = None) -> torch.Tensor:
        """``x``: local ``[B, *seq_local, C]`` laid out as ``spec`` (default: the open
        region's layout) → same shape."""
        if sp is None:
            region = context.current(f"{type(self).__name__}(x) without (spec, sp)")
            sp, spec = region.sp, region.spec() if spec is None else spec
        x, inner = sp.tp_enter(x, spec)
        q, k, v = rearrange(
            self.qkv(x), "... (three h d) -> three ... h d", three=3, d=self.head_dim
        )
        out = sp.attention(q, k, v, inner, over=self.over, causal=self.causal)
        return sp.tp_exit(self.proj, rearrange(out, "... h d -> ... (h d)"), spec)


class CrossAttention(torch.nn.Module):
    """Tokens attend to replicated context tokens; mixes no sequence dim.

    ``x``: ``[B, *tokens, C]``; ``context``: ``[B, L, C]``; ``context_mask``: ``[B, L]`` bool
    (True = attend) or ``None``.
    """

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.q = torch.nn.Linear(hidden, hidden)
        self.kv = torch.nn.Linear(hidden, 2 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        shape = x.shape
        q = rearrange(
            self.q(x).reshape(shape[0], -1, shape[-1]), "b n (h d) -> b n h d", h=self.heads
        )
        k, v = rearrange(self.kv(context), "b l (two h d) -> two b l h d", two=2, h=self.heads)
        mask = None if context_mask is None else context_mask[:, None, None, :].to(torch.bool)
        out = attend(q, k, v, mask=mask)
        return self.proj(rearrange(out, "b n h d -> b n (h d)")).reshape(shape)

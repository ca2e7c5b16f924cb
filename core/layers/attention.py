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
) -> torch.Tensor:
    """Scaled dot-product attention on ``[N, L, H, D]`` tensors → ``[N, Lq, H, D]``.

    ``mask`` (boolean, True = attend) broadcasts to ``[N, H, Lq, Lk]``.
    """
    if can_use_flash(q, mask):
        return flash_attn_func()(q, k, v, dropout_p=dropout_p, causal=causal)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal,
    )
    return out.transpose(1, 2)

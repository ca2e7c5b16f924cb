"""Fixed sin-cos position tables and the sinusoidal timestep embedder."""

from __future__ import annotations

import math

import torch
from torch import nn


def sincos_1d(length: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[length, dim]`` sin-cos table for positions ``0 … length − 1`` (``dim`` even)."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding needs an even dim, got {dim}")
    freqs = torch.exp(-math.log(base) * torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()


def sincos_2d(height: int, width: int, dim: int) -> torch.Tensor:
    """``[height·width, dim]`` table: half the channels encode the row, half the column."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs dim divisible by 4, got {dim}")
    rows = sincos_1d(height, dim // 2)[:, None, :].expand(height, width, dim // 2)
    cols = sincos_1d(width, dim // 2)[None, :, :].expand(height, width, dim // 2)
    return torch.cat([rows, cols], dim=-1).reshape(height * width, dim)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps ``[B]`` → ``[B, hidden]`` through sinusoidal features and an MLP."""

    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(
            -math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half
        )
        angles = t.float()[:, None] * freqs[None]
        feats = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))

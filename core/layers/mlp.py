"""Token-wise MLP and adaLN modulation."""

from __future__ import annotations

import torch
from torch import nn


class Mlp(nn.Module):
    """``[..., C]`` → ``[..., C]`` with a GELU (tanh) hidden layer of ``ratio · C``."""

    def __init__(self, hidden: int, ratio: float = 4.0) -> None:
        super().__init__()
        width = int(hidden * ratio)
        self.fc1 = nn.Linear(hidden, width)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x · (1 + scale) + shift``; ``shift``/``scale`` ``[B, C]`` broadcast over tokens."""
    extra = x.dim() - shift.dim()
    shape = (shift.shape[0],) + (1,) * extra + (shift.shape[-1],)
    return x * (1 + scale.reshape(shape)) + shift.reshape(shape)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``gate`` ``[B, C]`` times ``x`` ``[B, ..., C]``."""
    return x * gate.reshape((gate.shape[0],) + (1,) * (x.dim() - 2) + (gate.shape[-1],))

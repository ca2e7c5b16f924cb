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


def _per_token(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` → ``[B, 1, …, 1, C]`` to broadcast over ``x``'s tokens; a ``p`` with as many
    dims as ``x`` (e.g. per-frame ``[B, T, 1, C]``) is used as it is."""
    if p.dim() == x.dim():
        return p
    return p.reshape((p.shape[0],) + (1,) * (x.dim() - 2) + (p.shape[-1],))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x · (1 + scale) + shift`` for ``x`` ``[B, *tokens, C]``.

    ``shift``/``scale``: ``[B, C]`` (one per sample) or broadcastable with ``x`` (e.g. per-frame
    ``[B, T, 1, C]``).
    """
    return x * (1 + _per_token(scale, x)) + _per_token(shift, x)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``gate`` (``[B, C]`` or broadcastable with ``x``) times ``x`` ``[B, *tokens, C]``."""
    return x * _per_token(gate, x)

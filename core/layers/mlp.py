"""Token-wise MLP, adaLN modulation and the adaLN output layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel import context


class Mlp(nn.Module):
    """``[..., C]`` → ``[..., C]`` with a GELU (tanh) hidden layer of ``ratio · C``.

    ``TP_PLAN``: under tensor parallelism (``megatron_sp``) ``fc1`` is column-parallel and
    ``fc2`` row-parallel (hidden units sharded): the ``sp.tp_enter``/``sp.tp_exit`` hooks act
    on the activation's ``spec`` and the SP context, passed explicitly or read from the open
    region (:mod:`dspzoo.core.parallel.context`); outside a region and without them: a plain MLP.
    """

    TP_PLAN = {"fc1": "column", "fc2": "row"}

    def __init__(self, hidden: int, ratio: float = 4.0) -> None:
        super().__init__()
        width = int(hidden * ratio)
        self.fc1 = nn.Linear(hidden, width)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor, spec: Any = None, sp: Any = None) -> torch.Tensor:
        if sp is None and context.active() is not None:
            region = context.current("Mlp")
            sp, spec = region.sp, region.spec() if spec is None else spec
        if sp is None:
            return self.fc2(self.act(self.fc1(x)))
        h, _ = sp.tp_enter(x, spec)
        return sp.tp_exit(self.fc2, self.act(self.fc1(h)), spec)


def _per_token(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` → ``[B, 1, …, 1, C]`` to broadcast over ``x``'s tokens; a ``p`` with as many
    dims as ``x`` (e.g. per-frame ``[B, T, 1, C]``) is laid out like the activation: inside an
    open region it is sliced for the current layout (:func:`dspzoo.core.parallel.context.local`),
    outside one used as it is."""
    if p.dim() == x.dim():
        return context.local(p)
    return p.reshape((p.shape[0],) + (1,) * (x.dim() - 2) + (p.shape[-1],))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x · (1 + scale) + shift`` for ``x`` ``[B, *tokens, C]``.

    ``shift``/``scale``: ``[B, C]`` (one per sample) or broadcastable with ``x`` (e.g. per-frame
    ``[B, T, 1, C]``, whole inside an open region: sliced here for the current layout).
    """
    return x * (1 + _per_token(scale, x)) + _per_token(shift, x)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``gate`` (``[B, C]`` or broadcastable with ``x``) times ``x`` ``[B, *tokens, C]``."""
    return x * _per_token(gate, x)


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm + linear, per token: ``[B, *tokens, C]`` → ``[B, *tokens, out]``
    under conditioning ``c`` ``[B, C]`` (or broadcastable, see :func:`modulate`)."""

    def __init__(self, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))

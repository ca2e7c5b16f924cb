"""STDiT (OpenSora-v1-like): spatial, temporal and cross-attention plus an MLP in every layer.

Per layer: spatial self-attention mixes ``s``, temporal self-attention mixes ``t``, cross-
attention to replicated conditioning tokens and the MLP mix nothing. Under DSP the plan keeps
``t`` sharded for the spatial stage and ``s`` sharded from the temporal stage on: exactly two
switches per layer, the minimum. Timestep modulation is adaLN-single: one shared projection of
the conditioning vector plus a per-layer learned table, both zero at init, and the cross-
attention output projection starts at zero, so every layer starts as the identity (adaLN-Zero).
"""

from __future__ import annotations

import torch
from torch import nn

from dspzoo.core import Stage
from dspzoo.core.layers.attention import CrossAttention, SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp, gated, modulate
from dspzoo.core.parallel.context import stage

from .dit import VideoDiT, VideoDiTConfig


def layer_stages(full: bool, tag: str = "") -> tuple[Stage, ...]:
    """The stages of one layer: axial (spatial, temporal) or full (``t`` and ``s`` at once).

    ``tag`` distinguishes the layers of a period of different layers (``"@0"``, ``"@1"``…).
    """
    attention = (
        (Stage(f"full{tag}", ("t", "s")),)
        if full
        else (Stage(f"spatial{tag}", ("s",)), Stage(f"temporal{tag}", ("t",)))
    )
    return (*attention, Stage(f"cross{tag}"), Stage(f"mlp{tag}"))


class STDiTBlock(nn.Module):
    """One STDiT layer over ``[B, T, S, C]`` activations.

    Axial (spatial then temporal self-attention) or, with ``full=True``, one self-attention
    over all ``T·S`` tokens; ``tag`` suffixes its stage names (see :func:`layer_stages`).
    """

    def __init__(self, config: VideoDiTConfig, full: bool = False, tag: str = "") -> None:
        super().__init__()
        h = config.hidden
        self.tag, self.first = tag, f"full{tag}" if full else f"spatial{tag}"
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.spatial = SeqSelfAttention(h, config.heads, over=("t", "s") if full else "s")
        self.temporal = None if full else SeqSelfAttention(h, config.heads, over="t")
        self.cross = CrossAttention(h, config.heads) if config.cond_dim else None
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(h, config.mlp_ratio)
        self.table = nn.Parameter(torch.zeros(6, h))  # per-layer shift/scale/gate offsets

    def zero_init(self) -> None:
        """Identity at init: zero gates (table) and zero cross-attention output."""
        nn.init.zeros_(self.table)
        if self.cross is not None:
            nn.init.zeros_(self.cross.proj.weight)
            nn.init.zeros_(self.cross.proj.bias)

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` local ``[B, T'_l, S_l, C]``; ``mod`` ``[B, 6, C]`` or per frame ``[B, T', 1, 6, C]``."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (mod + self.table).unbind(-2)
        x = stage(self.first, x)  # "spatial" (or "full": t and s at once)
        x = x + gated(self.spatial(modulate(self.norm1(x), shift_a, scale_a)), gate_a)
        if self.temporal is not None:
            x = stage(f"temporal{self.tag}", x)
            x = x + gated(self.temporal(modulate(self.norm1(x), shift_a, scale_a)), gate_a)
        x = stage(f"cross{self.tag}", x)
        if self.cross is not None and context is not None:
            x = x + self.cross(x, context, context_mask)
        x = stage(f"mlp{self.tag}", x)
        return x + gated(self.mlp(modulate(self.norm2(x), shift_m, scale_m)), gate_m)


class STDiT(VideoDiT):
    """Spatial-temporal DiT; see the module docstring."""

    STAGES = layer_stages(full=False)

    def __init__(self, config: VideoDiTConfig) -> None:
        super().__init__(config)
        self.mod = nn.Sequential(nn.SiLU(), nn.Linear(config.hidden, 6 * config.hidden))
        k = config.full_attention_every
        if k < 0:
            raise ValueError(f"full_attention_every must be >= 0, got {k}")
        if k:  # a period of k layers, the last of them full: one plan step per (layer, stage)
            self.STAGES = tuple(
                stage for j in range(k) for stage in layer_stages(j == k - 1, f"@{j}")
            )
            blocks = (STDiTBlock(config, i % k == k - 1, f"@{i % k}") for i in range(config.depth))
        else:
            blocks = (STDiTBlock(config) for _ in range(config.depth))
        self.blocks = nn.ModuleList(blocks)
        self.initialize_weights()
        nn.init.zeros_(self.mod[-1].weight)
        nn.init.zeros_(self.mod[-1].bias)

    def block_inputs(self, c: torch.Tensor) -> torch.Tensor:
        """Shared per-layer modulation ``[B, 6, C]`` (per frame: ``[B, T', 1, 6, C]``)."""
        return self.mod(c).unflatten(-1, (6, self.config.hidden))

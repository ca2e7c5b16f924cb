"""Latte-like video DiT: spatial-only and temporal-only transformer blocks, alternating.

Block ``2i`` attends over ``s`` (within each frame), block ``2i + 1`` over ``t`` (each patch
position through time); both have optional cross-attention and an MLP, each with its own
adaLN-Zero modulation. Under DSP a spatial block runs sharded on ``t`` and a temporal block
sharded on ``s``: two switches per pair of blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from dspzoo.core import Stage
from dspzoo.core.layers.attention import CrossAttention, SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp, gated, modulate
from dspzoo.core.parallel.context import stage

from .dit import VideoDiT, VideoDiTConfig


class LatteBlock(nn.Module):
    """Self-attention over one dim (``"s"`` or ``"t"``), cross-attention, MLP; adaLN-Zero."""

    def __init__(self, config: VideoDiTConfig, over: str) -> None:
        super().__init__()
        h = config.hidden
        self.kind = "spatial" if over == "s" else "temporal"
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = SeqSelfAttention(h, config.heads, over=over)
        self.cross = CrossAttention(h, config.heads) if config.cond_dim else None
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(h, config.mlp_ratio)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))

    def zero_init(self) -> None:
        """Identity at init: zero modulation (so zero gates) and zero cross-attention output."""
        nn.init.zeros_(self.ada[-1].weight)
        nn.init.zeros_(self.ada[-1].bias)
        if self.cross is not None:
            nn.init.zeros_(self.cross.proj.weight)
            nn.init.zeros_(self.cross.proj.bias)

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` local ``[B, T'_l, S_l, C]``; ``c``: ``[B, C]`` or per frame ``[B, T', 1, C]``."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(c).chunk(6, dim=-1)
        x = stage(f"{self.kind}_attn", x)
        x = x + gated(self.attn(modulate(self.norm1(x), shift_a, scale_a)), gate_a)
        x = stage(f"{self.kind}_cross", x)
        if self.cross is not None and context is not None:
            x = x + self.cross(x, context, context_mask)
        x = stage(f"{self.kind}_mlp", x)
        return x + gated(self.mlp(modulate(self.norm2(x), shift_m, scale_m)), gate_m)


class Latte(VideoDiT):
    """Alternating spatial / temporal blocks; ``depth`` counts blocks (must be even)."""

    STAGES = tuple(
        Stage(f"{kind}_{part}", (dim,) if part == "attn" else ())
        for kind, dim in (("spatial", "s"), ("temporal", "t"))
        for part in ("attn", "cross", "mlp")
    )

    def __init__(self, config: VideoDiTConfig) -> None:
        if config.depth % 2:
            raise ValueError(
                f"Latte alternates spatial and temporal blocks: depth must be even, got {config.depth}"
            )
        if config.full_attention_every:
            raise ValueError(
                "full_attention_every is an STDiT option; Latte alternates spatial and temporal "
                "blocks"
            )
        super().__init__(config)
        self.blocks = nn.ModuleList(
            LatteBlock(config, "s" if i % 2 == 0 else "t") for i in range(config.depth)
        )
        self.initialize_weights()

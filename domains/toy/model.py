"""A minimal 2-D axial transformer over ``[B, T, S, C]`` — the model every port starts from.

It declares its sequence dims ``("t", "s")`` and its stages (spatial attention mixes ``s``,
temporal attention mixes ``t``, the MLP mixes nothing), and is written as if on one device:
the :class:`~dspzoo.core.SeqParallel` context decides where the switches go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region

SEQ_DIMS = ("t", "s")
STAGES = (Stage("spatial", ("s",)), Stage("temporal", ("t",)), Stage("mlp"))


@dataclass(frozen=True)
class Toy2DConfig:
    in_channels: int = 4
    hidden: int = 32
    heads: int = 4
    depth: int = 2
    mlp_ratio: float = 2.0
    max_t: int = 16
    max_s: int = 64


class AxialAttention(nn.Module):
    """Self-attention along one sequence dim of ``[B, *seq, C]``.

    ``TP_PLAN`` declares its linears for tensor parallelism (``megatron_sp``): ``qkv``
    column-parallel (q, k, v stacked, each sharded by heads), ``proj`` row-parallel. The
    ``sp.tp_enter``/``sp.tp_exit`` hooks do nothing under other strategies.
    """

    TP_PLAN = {"qkv": ("column", 3), "proj": "row"}

    def __init__(self, hidden: int, heads: int, over: str) -> None:
        super().__init__()
        self.heads, self.head_dim, self.over = heads, hidden // heads, over
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        x = act.tensor
        h, inner = sp.tp_enter(self.norm(x), act.spec)
        q, k, v = rearrange(
            self.qkv(h), "... (three h d) -> three ... h d", three=3, d=self.head_dim
        )
        out = sp.attention(q, k, v, inner, over=self.over)
        return act.with_tensor(
            x + sp.tp_exit(self.proj, rearrange(out, "... h d -> ... (h d)"), act.spec)
        )


class ToyMlp(nn.Sequential):
    """LayerNorm, linear, GELU, linear (a ``Sequential``: parameter names ``0``…``3``).

    ``TP_PLAN``: the first linear column-parallel, the second row-parallel (``megatron_sp``).
    """

    TP_PLAN = {"1": "column", "3": "row"}

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__(
            nn.LayerNorm(hidden), nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, hidden)
        )

    def forward(self, act: SeqTensor, sp: SeqParallel) -> torch.Tensor:
        norm, fc1, gelu, fc2 = self
        h, _ = sp.tp_enter(norm(act.tensor), act.spec)
        return sp.tp_exit(fc2, gelu(fc1(h)), act.spec)


class Block(nn.Module):
    def __init__(self, cfg: Toy2DConfig) -> None:
        super().__init__()
        self.spatial = AxialAttention(cfg.hidden, cfg.heads, "s")
        self.temporal = AxialAttention(cfg.hidden, cfg.heads, "t")
        self.mlp = ToyMlp(cfg.hidden, int(cfg.hidden * cfg.mlp_ratio))

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        act = self.spatial(sp.to_stage(act, "spatial"), sp)
        act = self.temporal(sp.to_stage(act, "temporal"), sp)
        act = sp.to_stage(act, "mlp")
        return act.with_tensor(act.tensor + self.mlp(act, sp))


class Toy2DTransformer(nn.Module):
    """``[B, T, S, in_channels]`` → same shape; a learned positional table per (t, s) slot."""

    def __init__(self, config: Toy2DConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Linear(config.in_channels, config.hidden)
        self.pos_t = nn.Parameter(torch.randn(1, config.max_t, 1, config.hidden) * 0.02)
        self.pos_s = nn.Parameter(torch.randn(1, 1, config.max_s, config.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.head = nn.Sequential(
            nn.LayerNorm(config.hidden), nn.Linear(config.hidden, config.in_channels)
        )

    def forward(
        self, x: torch.Tensor, sp: SeqParallel | None = None, gather_output: bool = True
    ) -> torch.Tensor | SeqTensor:
        """``x``: replicated ``[B, T, S, C_in]``. Returns the replicated output, or (when
        ``gather_output`` is False) this rank's shard of it as a :class:`SeqTensor`, for a loss
        on sharded tokens."""
        sp = sp or SeqParallel()
        b, t, s, c = x.shape
        if c != self.config.in_channels:
            raise ValueError(
                f"expected {self.config.in_channels} input channels, got {c} (shape {tuple(x.shape)})"
            )
        act = sp.enter(x, SEQ_DIMS, STAGES)
        pos = self.pos_t[:, :t] + self.pos_s[:, :, :s]  # [1, T, S, C], replicated
        act = act.with_tensor(self.embed(act.tensor) + sp.shard_like(pos, act))
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, sp)
        act = act.with_tensor(self.head(act.tensor))
        return sp.exit(act) if gather_output else act

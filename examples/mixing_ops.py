"""Stages that are not attention: a convolution along time and a 2-D pooling stage.

Two small models that show how a stage declares *what* it computes, so every strategy runs it
exactly (see docs/new_architecture.md, "Op kinds"):

* :class:`ConvVideo` ``[B, T, S, C]``: spatial self-attention over ``s``, a depthwise
  ``Conv1d`` along ``t`` (``op="generic"``), an MLP. Under Ulysses or Ring, which shard one dim
  for the whole model, the convolution stage would otherwise see only this rank's frames; the
  planner instead gives it ``t`` whole with a switch, as DSP does.
* :class:`Grid2D` ``[B, H, W, C]``: a period of two layers, the first with row attention
  (``w``) and column attention (``h``), the second with one full 2-D attention over ``(h, w)``
  (an embedded method under DSP: a hybrid plan); both end with a 3 × 3 average pooling over
  ``(h, w)`` (generic, mixing every dim: gathered whole for the stage) and an MLP.

Both follow the runtime API of the worked example (``sp.enter`` / ``sp.to_stage`` /
``sp.exit``); the harness checks them under every strategy (tests/test_op_kinds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.costmodel import StageSpec, Workload
from dspzoo.core.layers.attention import SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp


@dataclass(frozen=True)
class MixerConfig:
    """Width, heads and depth of both example models; ``kernel`` of the temporal conv."""

    in_channels: int = 3
    hidden: int = 16
    heads: int = 4
    depth: int = 2
    kernel: int = 3


def _check_input(x: torch.Tensor, cfg: MixerConfig, what: str) -> None:
    if x.dim() != 4 or x.shape[-1] != cfg.in_channels:
        raise ValueError(
            f"{what} wants [B, L1, L2, {cfg.in_channels}] inputs, got {tuple(x.shape)}"
        )


# -- a convolution along time ------------------------------------------------------------------
class TemporalConv(nn.Module):
    """Depthwise ``Conv1d`` along ``t`` of ``[B, T, S, C]`` (``t`` must be whole): ``same``
    padding, so the output has the input's shape."""

    def __init__(self, hidden: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel, padding=kernel // 2, groups=hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        y = self.conv(rearrange(x, "b t s c -> (b s) c t"))
        return rearrange(y, "(b s) c t -> b t s c", b=b)


CONV_STAGES = (Stage("spatial", ("s",)), Stage("conv", ("t",), op="generic"), Stage("mlp"))


class ConvBlock(nn.Module):
    """Spatial attention, a temporal convolution, an MLP; pre-norm residuals."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(h), nn.LayerNorm(h), nn.LayerNorm(h)
        self.spatial = SeqSelfAttention(h, cfg.heads, over="s")
        self.conv = TemporalConv(h, cfg.kernel)
        self.mlp = Mlp(h, 2.0)

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        act = sp.to_stage(act, "spatial")
        x = act.tensor + self.spatial(self.norm1(act.tensor), act.spec, sp)
        act = sp.to_stage(act.with_tensor(x), "conv")
        x = act.tensor + self.conv(self.norm2(act.tensor))
        act = sp.to_stage(act.with_tensor(x), "mlp")
        return act.with_tensor(act.tensor + self.mlp(self.norm3(act.tensor), act.spec, sp))


class ConvVideo(nn.Module):
    """``[B, T, S, C_in]`` → ``[B, T, S, C_in]``: spatial attention + temporal conv layers."""

    STAGES = CONV_STAGES

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Linear(cfg.in_channels, cfg.hidden)
        self.blocks = nn.ModuleList(ConvBlock(cfg) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.hidden, cfg.in_channels)

    def forward(self, x: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"x": x}, check=lambda: _check_input(x, self.config, "ConvVideo"), what="ConvVideo"
        )
        act = sp.enter(x, ("t", "s"), self.STAGES)
        act = act.with_tensor(self.embed(act.tensor))
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, sp)
        return sp.exit(act.with_tensor(self.head(act.tensor)))


# -- a 2-D grid with row, column, full attention and pooling -----------------------------------
def grid_stages(tag: str, full: bool) -> tuple[Stage, ...]:
    """One layer's stages: axial (``row`` over ``w``, ``col`` over ``h``) or ``full`` 2-D
    attention, then ``pool`` (generic over both dims) and ``mlp``; ``tag`` is the layer's place
    in the period (``"@0"``, ``"@1"``)."""
    attention = (
        (Stage(f"full{tag}", ("h", "w")),)
        if full
        else (Stage(f"row{tag}", ("w",)), Stage(f"col{tag}", ("h",)))
    )
    return (*attention, Stage(f"pool{tag}", ("h", "w"), op="generic"), Stage(f"mlp{tag}"))


GRID_STAGES = (*grid_stages("@0", False), *grid_stages("@1", True))


class GridBlock(nn.Module):
    """Axial (row, column) or full 2-D attention, then 3 × 3 average pooling and an MLP."""

    def __init__(self, cfg: MixerConfig, full: bool, tag: str) -> None:
        super().__init__()
        h = cfg.hidden
        self.full, self.tag = full, tag
        self.norm_a, self.norm_b = nn.LayerNorm(h), nn.LayerNorm(h)
        self.norm_p, self.norm_m = nn.LayerNorm(h), nn.LayerNorm(h)
        self.first = SeqSelfAttention(h, cfg.heads, over=("h", "w") if full else "w")
        self.second = None if full else SeqSelfAttention(h, cfg.heads, over="h")
        self.pool_proj = nn.Linear(h, h)
        self.mlp = Mlp(h, 2.0)

    def _attend(self, act: SeqTensor, stage: str, attn: nn.Module, norm: nn.Module, sp):
        act = sp.to_stage(act, f"{stage}{self.tag}")
        return act.with_tensor(act.tensor + attn(norm(act.tensor), act.spec, sp))

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        act = self._attend(act, "full" if self.full else "row", self.first, self.norm_a, sp)
        if self.second is not None:
            act = self._attend(act, "col", self.second, self.norm_b, sp)
        act = sp.to_stage(act, f"pool{self.tag}")
        grid = rearrange(self.norm_p(act.tensor), "b h w c -> b c h w")
        pooled = F.avg_pool2d(grid, 3, stride=1, padding=1, count_include_pad=False)
        act = act.with_tensor(act.tensor + self.pool_proj(rearrange(pooled, "b c h w -> b h w c")))
        act = sp.to_stage(act, f"mlp{self.tag}")
        return act.with_tensor(act.tensor + self.mlp(self.norm_m(act.tensor), act.spec, sp))


class Grid2D(nn.Module):
    """``[B, H, W, C_in]`` → ``[B, H, W, C_in]``; layers alternate axial and full attention."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Linear(cfg.in_channels, cfg.hidden)
        self.blocks = nn.ModuleList(
            GridBlock(cfg, i % 2 == 1, f"@{i % 2}") for i in range(cfg.depth)
        )
        self.head = nn.Linear(cfg.hidden, cfg.in_channels)

    def forward(self, x: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"x": x}, check=lambda: _check_input(x, self.config, "Grid2D"), what="Grid2D"
        )
        act = sp.enter(x, ("h", "w"), GRID_STAGES)
        act = act.with_tensor(self.embed(act.tensor))
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, sp)
        return sp.exit(act.with_tensor(self.head(act.tensor)))


# -- what the cost model sees (the harness checks traced bytes against it) --------------------
def _spec(stage: Stage) -> StageSpec:
    if stage.op == "generic":
        return StageSpec(stage, adaln=False)
    if stage.mixes:
        return StageSpec(stage, attention=stage.mixes, tp_pairs=1, adaln=False)
    return StageSpec(stage, mlp=True, tp_pairs=1, adaln=False)


def mixer_workload(model: str, cfg: MixerConfig, batch: int, lengths: tuple[int, int]) -> Workload:
    """The cost model's view of one step of ``"conv_video"`` or ``"grid2d"`` on ``lengths``."""
    if model == "conv_video":
        dims, layers = ("t", "s"), (tuple(_spec(s) for s in CONV_STAGES),) * cfg.depth
        period = CONV_STAGES
    elif model == "grid2d":
        dims, period = ("h", "w"), GRID_STAGES
        per_layer = [tuple(_spec(s) for s in grid_stages(f"@{j}", j == 1)) for j in range(2)]
        layers = tuple(per_layer[i % 2] for i in range(cfg.depth))
    else:
        raise ValueError(f"unknown example model {model!r}; expected 'conv_video' or 'grid2d'")
    return Workload(model, model, batch, dims, lengths, cfg.hidden, cfg.heads, cfg.heads,
                    2 * cfg.hidden, layers, period, cfg.in_channels, cfg.in_channels,
                    itemsize=4)  # fmt: skip

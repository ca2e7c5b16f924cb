"""Spectro2D: a spectrogram transformer over (frequency, time) whose layers alternate.

The second walk through docs/new_architecture.md, on a model that is not the worked example:
a spectrogram ``[B, F, T, bins]`` (``bins`` values per time-frequency cell, e.g. one magnitude)
is embedded per cell, so the tokens form a 2-D grid over the sequence dims ``("f", "t")``, and
mapped to a spectrogram of the same shape (a denoiser, an enhancer). Layers come in a period of
two, told apart by the ``@0`` / ``@1`` suffix of their stage names:

* ``@0`` (axial): self-attention along ``t``, then a depthwise convolution along ``f`` — a
  *generic* op (``op="generic"``): no method can run it over a sharded ``f``, so every strategy
  gives it ``f`` whole;
* ``@1`` (full): one self-attention over all ``F·T`` cells — it mixes every dim, so DSP runs it
  with an embedded method (a hybrid plan);

each followed by an MLP. It is not in dspzoo's ``BUILTIN_MODULES``: like a family of your own
package it reaches ``dspzoo list/info/plan`` through ``DSPZOO_FAMILIES=dspzoo.examples.spectro2d``
(or a ``dspzoo.families`` entry point). ``tests/test_guide_walk.py`` walks it through the guide:
its plans, the harness under every strategy at SP 2, 3 and 4, and ``dspzoo plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.costmodel import StageSpec, Workload
from dspzoo.core.costmodel.workload import register_workload
from dspzoo.core.layers.attention import SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp
from dspzoo.zoo import register_config, register_family

SEQ_DIMS = ("f", "t")


def layer_stages(tag: str, full: bool) -> tuple[Stage, ...]:
    """One layer's stages, named with its place in the period (``tag``: ``"@0"``, ``"@1"``)."""
    mixers = (
        (Stage(f"full{tag}", ("f", "t")),)
        if full
        else (Stage(f"time{tag}", ("t",)), Stage(f"band{tag}", ("f",), op="generic"))
    )
    return (*mixers, Stage(f"mlp{tag}"))


STAGES = (*layer_stages("@0", full=False), *layer_stages("@1", full=True))  # one period


@dataclass(frozen=True)
class Spectro2DConfig:
    bins: int = 1  # values per time-frequency cell
    hidden: int = 32
    heads: int = 4
    depth: int = 2  # layers: @0, @1, @0, @1, ... (a whole number of periods)
    kernel: int = 3  # of the convolution along f
    mlp_ratio: float = 2.0
    max_freq: int = 512  # frequency bins the position table covers


class BandConv(nn.Module):
    """Depthwise ``Conv1d`` along ``f`` of ``[B, F, T, C]`` (``f`` whole), same length out."""

    def __init__(self, hidden: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel, padding=kernel // 2, groups=hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(rearrange(x, "b f t c -> (b t) c f"))
        return rearrange(y, "(b t) c f -> b f t c", b=x.shape[0])


class Layer(nn.Module):
    """``@0``: attention along ``t`` + convolution along ``f``; ``@1``: full 2-D attention.
    Then an MLP; pre-norm residuals throughout."""

    def __init__(self, cfg: Spectro2DConfig, full: bool, tag: str) -> None:
        super().__init__()
        h, self.full, self.tag = cfg.hidden, full, tag
        self.norm_a, self.norm_b, self.norm_m = nn.LayerNorm(h), nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = SeqSelfAttention(h, cfg.heads, over=("f", "t") if full else "t")
        self.conv = None if full else BandConv(h, cfg.kernel)
        self.mlp = Mlp(h, cfg.mlp_ratio)

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        act = sp.to_stage(act, f"{'full' if self.full else 'time'}{self.tag}")
        act = act.with_tensor(act.tensor + self.attn(self.norm_a(act.tensor), act.spec, sp))
        if self.conv is not None:
            act = sp.to_stage(act, f"band{self.tag}")  # f whole: a switch, as planned
            act = act.with_tensor(act.tensor + self.conv(self.norm_b(act.tensor)))
        act = sp.to_stage(act, f"mlp{self.tag}")
        return act.with_tensor(act.tensor + self.mlp(self.norm_m(act.tensor), act.spec, sp))


class Spectro2D(nn.Module):
    """``[B, F, T, bins]`` → ``[B, F, T, bins]`` (the input plus the model's change to it)."""

    def __init__(self, config: Spectro2DConfig) -> None:
        super().__init__()
        if config.depth % 2:
            raise ValueError(f"depth={config.depth}: layers alternate @0/@1, use an even depth")
        self.config = config
        self.embed = nn.Linear(config.bins, config.hidden)
        self.pos_f = nn.Parameter(torch.randn(config.max_freq, 1, config.hidden) * 0.02)
        self.blocks = nn.ModuleList(
            Layer(config, full=i % 2 == 1, tag=f"@{i % 2}") for i in range(config.depth)
        )
        self.head = nn.Linear(config.hidden, config.bins)

    def check(self, x: torch.Tensor) -> None:
        cfg = self.config
        if x.dim() != 4 or x.shape[-1] != cfg.bins:
            raise ValueError(f"Spectro2D wants [B, F, T, {cfg.bins}], got {tuple(x.shape)}")
        if x.shape[1] > cfg.max_freq:
            raise ValueError(f"{x.shape[1]} frequency bins > max_freq={cfg.max_freq}")

    def forward(self, x: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        sp.agree_entry({"x": x}, check=lambda: self.check(x), what="Spectro2D input")
        act = sp.enter(x, SEQ_DIMS, STAGES)  # sharded on the plan's entry dim
        pos = sp.shard_like(
            self.pos_f[: x.shape[1]], act, {"f": 0}
        )  # [F, 1, C], f sliced if sharded
        act = act.with_tensor(self.embed(act.tensor) + pos)
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, sp)
        return x + sp.exit(act.with_tensor(self.head(act.tensor)))


# -- the cost model's view: what runs in every stage ------------------------------------------
def stage_spec(stage: Stage) -> StageSpec:
    """A stage as the cost model sees it (a conv sends nothing of its own)."""
    if stage.op == "generic":
        return StageSpec(stage, adaln=False)
    if stage.mixes:
        return StageSpec(stage, attention=stage.mixes, tp_pairs=1, adaln=False)
    return StageSpec(stage, mlp=True, tp_pairs=1, adaln=False)


def workload(name, config, *, batch=1, frames=None, spatial=None, seq_len=None, context=0,
             itemsize=4, params=0) -> Workload:  # fmt: skip
    """One step on a spectrogram of ``spatial`` = ``(F, T)`` cells (``dspzoo plan --latent FxT``
    or ``--dims f=F,t=T``)."""
    if spatial is None:
        raise ValueError(f"{name}: give the spectrogram size, --latent FxT or --dims f=F,t=T")
    f, t = (spatial, spatial) if isinstance(spatial, int) else spatial
    layers = tuple(
        tuple(stage_spec(s) for s in layer_stages(f"@{i % 2}", full=i % 2 == 1))
        for i in range(config.depth)
    )
    return Workload(name, "spectro2d", batch, SEQ_DIMS, (f, t), config.hidden, config.heads,
                    config.heads, int(config.hidden * config.mlp_ratio), layers, STAGES,
                    config.bins, config.bins, params=params, itemsize=itemsize)  # fmt: skip


register_family("spectro2d", Spectro2D, Spectro2DConfig)
register_config("spectro2d", "tiny", Spectro2DConfig(hidden=16, heads=4, depth=2, max_freq=64))
register_config("spectro2d", "small", Spectro2DConfig())
register_workload("spectro2d", workload)

"""Axial3D: a 3-D axial transformer that predicts the next video frame (docs/new_architecture.md).

Frames ``[B, T, H, W, 3]`` are cut into ``p × p`` patches, giving tokens ``[B, T, h, w, 3p²]``
over the sequence dims ``("t", "h", "w")``. Every layer attends along ``t`` (causally: a token
sees its own and earlier frames), then ``h``, then ``w``, then runs an MLP; the output at frame
``t`` predicts frame ``t + 1``. Written as if on one device: the stages say which dims each
step mixes, and ``SeqParallel`` decides where the switches go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.costmodel import StageSpec, Workload
from dspzoo.core.costmodel.workload import register_workload
from dspzoo.core.layers.mlp import Mlp
from dspzoo.zoo import register_config, register_family

SEQ_DIMS = ("t", "h", "w")
TIME = Stage("time", ("t",), causal=True)  # attends to earlier frames only
STAGES = (TIME, Stage("height", ("h",)), Stage("width", ("w",)), Stage("mlp"))


@dataclass(frozen=True)
class Axial3DConfig:
    channels: int = 3  # colours per pixel
    patch: int = 4  # pixels per token side
    hidden: int = 64
    heads: int = 4
    depth: int = 2
    mlp_ratio: float = 2.0
    max_frames: int = 16
    max_side: int = 16  # tokens per spatial side


class AxialAttention(nn.Module):
    """Pre-norm self-attention along one sequence dim; ``TP_PLAN`` for ``megatron_sp``."""

    TP_PLAN = {"qkv": ("column", 3), "proj": "row"}

    def __init__(self, cfg: Axial3DConfig, over: str, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads  # TP shards by heads
        self.over, self.causal = over, causal
        self.norm = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        h, spec = sp.tp_enter(self.norm(act.tensor), act.spec)  # [B, t, h, w, C] (local)
        q, k, v = rearrange(self.qkv(h), "... (n h d) -> n ... h d", n=3, d=self.head_dim)
        out = sp.attention(q, k, v, spec, over=self.over, causal=self.causal)
        out = sp.tp_exit(self.proj, rearrange(out, "... h d -> ... (h d)"), act.spec)
        return act.with_tensor(act.tensor + out)


class Block(nn.Module):
    def __init__(self, cfg: Axial3DConfig) -> None:
        super().__init__()
        self.time = AxialAttention(cfg, "t", causal=True)
        self.height = AxialAttention(cfg, "h")
        self.width = AxialAttention(cfg, "w")
        self.norm = nn.LayerNorm(cfg.hidden)
        self.mlp = Mlp(cfg.hidden, cfg.mlp_ratio)

    def forward(self, act: SeqTensor, sp: SeqParallel) -> SeqTensor:
        for stage in ("time", "height", "width"):
            act = getattr(self, stage)(sp.to_stage(act, stage), sp)
        act = sp.to_stage(act, "mlp")
        return act.with_tensor(act.tensor + self.mlp(self.norm(act.tensor), act.spec, sp))


class Axial3D(nn.Module):
    """``[B, T, H, W, 3]`` frames in ``[-1, 1]`` → predicted next frames (each frame plus the
    predicted change), same shape."""

    def __init__(self, config: Axial3DConfig) -> None:
        super().__init__()
        c, width = config, config.channels * config.patch**2
        self.config = c
        self.embed = nn.Linear(width, c.hidden)
        self.pos_t = nn.Parameter(torch.randn(c.max_frames, 1, 1, c.hidden) * 0.02)
        self.pos_h = nn.Parameter(torch.randn(c.max_side, 1, c.hidden) * 0.02)
        self.pos_w = nn.Parameter(torch.randn(c.max_side, c.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.head = nn.Sequential(nn.LayerNorm(c.hidden), nn.Linear(c.hidden, width))

    def check(self, video: torch.Tensor) -> None:
        """Raise a clear ``ValueError`` for frames this model cannot take."""
        c = self.config
        if video.dim() != 5 or video.shape[-1] != c.channels:
            raise ValueError(
                f"Axial3D wants [B, T, H, W, {c.channels}] frames, got {tuple(video.shape)}"
            )
        _, t, height, width, _ = video.shape
        if height % c.patch or width % c.patch:
            raise ValueError(f"frame size {height}x{width} is not a multiple of patch={c.patch}")
        if t > c.max_frames or max(height, width) > c.max_side * c.patch:
            raise ValueError(
                f"{t} frames of {height}x{width} exceed max_frames={c.max_frames} or "
                f"{c.max_side * c.patch} pixels a side (max_side={c.max_side}, patch={c.patch})"
            )

    def forward(self, video: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        sp.agree_entry({"video": video}, check=lambda: self.check(video), what="Axial3D frames")
        p = self.config.patch
        x = rearrange(video, "b t (h p) (w q) c -> b t h w (p q c)", p=p, q=p)
        _, t, h, w, _ = x.shape
        act = sp.enter(x, SEQ_DIMS, STAGES)  # sharded on the plan's entry dim
        pos = self.pos_t[:t] + self.pos_h[:h] + self.pos_w[:w]  # [T, h, w, C], replicated
        act = act.with_tensor(
            self.embed(act.tensor) + sp.shard_like(pos, act, {"t": 0, "h": 1, "w": 2})
        )
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                act = block(act, sp)
        out = sp.exit(act.with_tensor(self.head(act.tensor)))  # [B, T, h, w, 3p²], replicated
        return video + rearrange(out, "b t h w (p q c) -> b t (h p) (w q) c", p=p, q=p)


def workload(
    name: str,
    config: Axial3DConfig,
    *,
    frames: int,
    spatial: int | tuple[int, int],
    batch: int = 1,
    itemsize: int = 4,
    params: int = 0,
    **_: object,
) -> Workload:
    """The cost model's view of one step on ``frames`` frames of ``spatial`` (H or (H, W)) pixels:
    what runs in every stage. Used by ``dspzoo plan`` and the harness's byte check."""
    if frames is None or spatial is None:
        raise ValueError(f"{name} needs --frames and the frame size in pixels (--size or --latent)")
    h, w = (spatial, spatial) if isinstance(spatial, int) else spatial
    p, width = config.patch, config.channels * config.patch**2
    layer = (
        *(StageSpec(s, attention=s.mixes, tp_pairs=1, adaln=False) for s in STAGES[:3]),
        StageSpec(STAGES[3], mlp=True, tp_pairs=1, adaln=False),
    )
    return Workload(name, "axial3d", batch, SEQ_DIMS, (frames, h // p, w // p), config.hidden,
                    config.heads, config.heads, int(config.hidden * config.mlp_ratio),
                    (layer,) * config.depth, STAGES, width, width, params=params,
                    itemsize=itemsize)  # fmt: skip


register_family("axial3d", Axial3D, Axial3DConfig)
register_config("axial3d", "tiny", Axial3DConfig(patch=2, hidden=16, heads=4, depth=1))
register_config("axial3d", "mini", Axial3DConfig())
register_workload("axial3d", workload)

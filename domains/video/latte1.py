"""Latte-1: the exact architecture of diffusers' ``LatteTransformer3DModel``, under DSP.

The public Latte-1 text-to-video weights are distributed in that format;
:mod:`dspzoo.zoo.convert.diffusers_latte` converts such a folder into this model. What it
computes, for latents ``[B, C, F, H, W]``, caption embeddings ``[B, L, caption_channels]``
and timesteps ``[B]``:

* **patch embedding**: ``p × p`` patches of every frame (a strided Conv2d in diffusers; here a
  linear layer on patches rearranged first, so the sequence-parallel split happens on raw
  patches), plus a fixed 2-D sin-cos table whose positions are scaled to a base grid of
  ``sample_size / p`` and divided by ``max(sample_size // 64, 1)``
  (:func:`spatial_table`); the first half of the channels encodes the *column*, the second
  half the *row*;
* **adaLN-single** (PixArt-α): one timestep embedding ``e`` ``[B, hidden]`` and one shared
  projection ``t_mod(silu(e))`` ``[B, 6·hidden]``; every block adds its own learned
  ``scale_shift_table`` ``[6, hidden]`` to get shift/scale/gate for attention and MLP;
* **caption projection**: linear, GELU (tanh), linear → ``[B, L, hidden]``;
* ``depth`` pairs of blocks: a **spatial** block (self-attention over the tokens of each frame,
  then cross-attention to the caption — no norm before it, no gate — then the MLP) and a
  **temporal** block (self-attention over frames at each position, no cross-attention, MLP);
  the **temporal position table** (1-D sin-cos over ``video_length`` frames, a non-persistent
  buffer in diffusers, recomputed here) is added once, right before the first temporal block,
  and only when there is more than one frame;
* **final layer**: LayerNorm (eps 1e-6, no affine), modulated by ``out_table [2, hidden] + e``
  (the timestep embedding itself, not its SiLU), linear to ``p·p·out_channels`` (Latte-1
  learns sigma: ``out_channels = 2·in_channels``).

Norms before attention and MLP use ``norm_eps`` and ``norm_elementwise_affine`` from the
config; attention has ``heads`` heads of ``head_dim`` (so ``hidden = heads · head_dim``), q/k/v
biases per ``attention_bias``, an output bias always; the MLP is ``hidden → 4·hidden → hidden``
with GELU (tanh approximation for ``"gelu-approximate"``).

Under DSP the activation ``[B, F, S, hidden]`` (dims ``t`` = frames, ``s`` = patches per
frame) is sharded on ``t`` for the spatial stages and on ``s`` for the temporal ones: two
switches per pair of blocks; every other strategy runs the same code with its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.layers.attention import SeqSelfAttention, attend
from dspzoo.core.layers.embeddings import TimestepEmbedder
from dspzoo.core.layers.mlp import Mlp, gated, modulate

from .dit import patchify, unpatchify

SEQ_DIMS = ("t", "s")
ACTIVATIONS = {"gelu-approximate": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class Latte1Config:
    """Architecture of a Latte-1 transformer (the fields of diffusers' config, renamed).

    ``depth`` counts spatial/temporal *pairs* (diffusers' ``num_layers``); ``hidden`` is
    ``heads · head_dim``; ``out_channels = 0`` means ``in_channels``. ``sample_size`` (the
    training latent size) only sets the spatial position table's scaling; any latent size
    divisible by ``patch`` runs. ``video_length`` is the number of latent frames the temporal
    position table has: inputs must have exactly that many frames, or one (image mode).
    ``cross_attention=False`` builds spatial blocks without cross-attention (the caption
    projection is kept: diffusers always has it).
    """

    in_channels: int = 4
    out_channels: int = 8
    heads: int = 16
    head_dim: int = 72
    depth: int = 28
    patch: int = 2
    sample_size: int = 64
    video_length: int = 16
    caption_channels: int = 4096
    cross_attention: bool = True
    attention_bias: bool = True
    norm_eps: float = 1e-6
    norm_elementwise_affine: bool = False
    activation: str = "gelu-approximate"

    @property
    def hidden(self) -> int:
        """Model width, ``heads · head_dim``."""
        return self.heads * self.head_dim

    @property
    def channels_out(self) -> int:
        """Channels of the output (``out_channels``, or ``in_channels`` when it is 0)."""
        return self.out_channels or self.in_channels

    @property
    def base_size(self) -> int:
        """Token grid the spatial position table is scaled to (``sample_size // patch``)."""
        return self.sample_size // self.patch

    @property
    def interpolation_scale(self) -> int:
        """Divisor of the spatial positions: ``max(sample_size // 64, 1)``."""
        return max(self.sample_size // 64, 1)


# -- fixed position tables ---------------------------------------------------------------------
def sincos_at(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """``[M, dim]`` float64 table ``[sin(p·ω), cos(p·ω)]``, ``ω_i = 10000^(−i/(dim/2))``.

    ``positions`` ``[M]`` (any real dtype) is promoted to float64 before the product.
    """
    if dim % 2:
        raise ValueError(f"sin-cos embedding needs an even dim, got {dim}")
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.outer(positions.reshape(-1).to(torch.float64), omega)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


@lru_cache(maxsize=16)
def spatial_table(
    grid_h: int, grid_w: int, dim: int, base_size: int, interpolation_scale: float
) -> torch.Tensor:
    """``[grid_h·grid_w, dim]`` float32 table for the patches of one frame, row-major.

    Row ``i`` sits at ``i / (grid_h / base_size) / interpolation_scale`` (float32 arithmetic),
    columns likewise with ``grid_w``; channels ``[: dim/2]`` encode the column, ``[dim/2 :]``
    the row. Built on the CPU (a meta-device context must not leave meta tensors cached).
    """
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding needs hidden divisible by 4, got {dim}")
    with torch.device("cpu"):
        rows = torch.arange(grid_h, dtype=torch.float32) / (grid_h / base_size)
        cols = torch.arange(grid_w, dtype=torch.float32) / (grid_w / base_size)
        rows, cols = rows / interpolation_scale, cols / interpolation_scale
        row_of = rows[:, None].expand(grid_h, grid_w)
        col_of = cols[None, :].expand(grid_h, grid_w)
        return torch.cat([sincos_at(col_of, dim // 2), sincos_at(row_of, dim // 2)], 1).float()


@lru_cache(maxsize=16)
def temporal_table(frames: int, dim: int) -> torch.Tensor:
    """``[frames, dim]`` float32 table for frames ``0 … frames − 1`` (CPU)."""
    with torch.device("cpu"):
        return sincos_at(torch.arange(frames), dim).float()


# -- blocks ------------------------------------------------------------------------------------
class CaptionCrossAttention(nn.Module):
    """Every token attends to the replicated caption tokens; mixes no sequence dim.

    ``x`` ``[B, *tokens, hidden]``, ``context`` ``[B, L, hidden]``, ``mask`` ``[B, L]`` bool
    (True = attend) or ``None`` → ``[B, *tokens, hidden]``.
    """

    def __init__(self, hidden: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.kv = nn.Linear(hidden, 2 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        q = rearrange(self.q(x.flatten(1, -2)), "b n (h d) -> b n h d", h=self.heads)
        k, v = rearrange(self.kv(context), "b l (two h d) -> two b l h d", two=2, h=self.heads)
        keep = None if mask is None else mask[:, None, None, :].to(torch.bool)
        out = rearrange(attend(q, k, v, mask=keep), "b n h d -> b n (h d)")
        return self.proj(out).reshape(x.shape)


class Latte1Block(nn.Module):
    """Self-attention over ``"s"`` (spatial) or ``"t"`` (temporal), cross-attention (spatial
    only), MLP; modulated by adaLN-single (the shared ``[B, 6·hidden]`` plus this block's
    ``scale_shift_table``)."""

    def __init__(self, config: Latte1Config, over: str) -> None:
        super().__init__()
        h, c = config.hidden, config
        self.kind = "spatial" if over == "s" else "temporal"
        self.scale_shift_table = nn.Parameter(torch.randn(6, h) / h**0.5)
        self.norm1 = nn.LayerNorm(h, eps=c.norm_eps, elementwise_affine=c.norm_elementwise_affine)
        self.attn = SeqSelfAttention(h, c.heads, over=over, qkv_bias=c.attention_bias)
        with_cross = over == "s" and c.cross_attention
        self.cross = CaptionCrossAttention(h, c.heads, c.attention_bias) if with_cross else None
        self.norm2 = nn.LayerNorm(h, eps=c.norm_eps, elementwise_affine=c.norm_elementwise_affine)
        self.mlp = Mlp(h, 4.0)
        self.mlp.act = nn.GELU(approximate=ACTIVATIONS[c.activation])

    def forward(
        self,
        act: SeqTensor,
        t_mod: torch.Tensor,
        caption: torch.Tensor | None,
        caption_mask: torch.Tensor | None,
        sp: SeqParallel,
    ) -> SeqTensor:
        """``t_mod``: the shared modulation ``[B, 6, hidden]``; ``caption`` ``[B, L, hidden]``."""
        mods = (self.scale_shift_table[None] + t_mod).unbind(1)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mods  # each [B, hidden]
        act = sp.to_stage(act, f"{self.kind}_attn")
        x = act.tensor
        x = x + gated(self.attn(modulate(self.norm1(x), shift_a, scale_a), act.spec, sp), gate_a)
        if self.cross is not None:
            act = sp.to_stage(act.with_tensor(x), "spatial_cross")
            x = act.tensor + self.cross(act.tensor, caption, caption_mask)
        act = sp.to_stage(act.with_tensor(x), f"{self.kind}_mlp")
        x = act.tensor
        x = x + gated(self.mlp(modulate(self.norm2(x), shift_m, scale_m), act.spec, sp), gate_m)
        return act.with_tensor(x)


# -- the model ---------------------------------------------------------------------------------
class Latte1(nn.Module):
    """diffusers' ``LatteTransformer3DModel`` (see the module docstring), sequence-parallel."""

    STAGES = (
        Stage("spatial_attn", ("s",)),
        Stage("spatial_cross"),
        Stage("spatial_mlp"),
        Stage("temporal_attn", ("t",)),
        Stage("temporal_mlp"),
    )

    def __init__(self, config: Latte1Config) -> None:
        super().__init__()
        c = self.config = config
        h = c.hidden
        if c.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {c.activation!r} is not supported; use one of {sorted(ACTIVATIONS)}"
            )
        if h % 4:
            raise ValueError(f"hidden = heads·head_dim = {h} must be divisible by 4")
        if c.patch < 1 or c.sample_size < c.patch or c.video_length < 1:
            raise ValueError(
                f"need patch ≥ 1, sample_size ≥ patch and video_length ≥ 1, got patch={c.patch}, "
                f"sample_size={c.sample_size}, video_length={c.video_length}"
            )
        self.x_embed = nn.Linear(c.in_channels * c.patch * c.patch, h)
        self.t_embed = TimestepEmbedder(h)
        self.t_mod = nn.Linear(h, 6 * h)
        self.caption = nn.Sequential(
            nn.Linear(c.caption_channels, h), nn.GELU(approximate="tanh"), nn.Linear(h, h)
        )
        self.spatial = nn.ModuleList(Latte1Block(c, "s") for _ in range(c.depth))
        self.temporal = nn.ModuleList(Latte1Block(c, "t") for _ in range(c.depth))
        self.norm_out = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.out_table = nn.Parameter(torch.randn(2, h) / h**0.5)
        self.out_proj = nn.Linear(h, c.patch * c.patch * c.channels_out)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """For training from scratch (a converted model overwrites all of it): Xavier linears
        with zero biases, N(0, 0.02) conditioning MLPs, zero cross-attention output and zero
        final projection (the first prediction is 0). The tables keep diffusers' N(0, 1/hidden)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for linear in (self.t_embed.mlp[0], self.t_embed.mlp[2], self.t_mod, *self.caption[::2]):
            nn.init.normal_(linear.weight, std=0.02)
        for block in self.spatial:
            if block.cross is not None:
                nn.init.zeros_(block.cross.proj.weight)
        nn.init.zeros_(self.out_proj.weight)

    # -- inputs -----------------------------------------------------------------------------
    def check_inputs(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: torch.Tensor | None,
        cond_mask: torch.Tensor | None,
        temporal: bool,
    ) -> None:
        """Raise a clear ``ValueError`` for inputs this model cannot take."""
        c = self.config
        if x.dim() != 5 or x.shape[1] != c.in_channels:
            raise ValueError(
                f"Latte1 expects latents [B, C={c.in_channels}, F, H, W], got shape {tuple(x.shape)}"
            )
        b, _, frames, height, width = x.shape
        if height % c.patch or width % c.patch:
            raise ValueError(
                f"latent height {height} and width {width} must be divisible by the patch size "
                f"{c.patch}"
            )
        if temporal and frames not in (1, c.video_length):
            raise ValueError(
                f"got {frames} latent frames, but this model's temporal position table has "
                f"video_length={c.video_length} rows: pass exactly {c.video_length} frames (or 1 "
                f"frame, image mode), or run without temporal attention (temporal=False)"
            )
        if timestep.shape != (b,):
            raise ValueError(f"timestep must be [B={b}], got shape {tuple(timestep.shape)}")
        if cond is None:
            if c.cross_attention:
                raise ValueError(
                    f"caption embeddings cond [B={b}, L, {c.caption_channels}] are required "
                    f"(the spatial blocks cross-attend to them)"
                )
            if cond_mask is not None:
                raise ValueError("cond_mask given without caption embeddings cond")
            return
        if cond.dim() != 3 or cond.shape[0] != b or cond.shape[2] != c.caption_channels:
            raise ValueError(
                f"caption embeddings cond must be [B={b}, L, caption_channels="
                f"{c.caption_channels}], got shape {tuple(cond.shape)}"
            )
        if cond_mask is not None and cond_mask.shape != cond.shape[:2]:
            raise ValueError(
                f"cond_mask must be [B, L] = {tuple(cond.shape[:2])}, got {tuple(cond_mask.shape)}"
            )

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: torch.Tensor | None = None,
        cond_mask: torch.Tensor | None = None,
        sp: SeqParallel | None = None,
        gather_output: bool = True,
        temporal: bool = True,
    ) -> torch.Tensor | SeqTensor:
        """Predict ``[B, channels_out, F, H, W]`` from noisy latents ``x`` ``[B, C, F, H, W]``.

        Args:
            timestep: ``[B]`` diffusion timesteps (0 … 1000 for Latte-1).
            cond: caption embeddings ``[B, L, caption_channels]`` (T5 for Latte-1), replicated.
            cond_mask: ``[B, L]`` bool, True for real caption tokens (masked cross-attention;
                diffusers' own forward cannot take a mask with more than one frame).
            sp: the sequence-parallel context (``None``: one process).
            gather_output: return the replicated output; otherwise this rank's shard in token
                layout ``[B, F_l, S_l, p·p·channels_out]`` as a :class:`SeqTensor`.
            temporal: ``False`` skips the temporal blocks and the temporal position table
                (diffusers' ``enable_temporal_attentions=False``; any number of frames).

        Inputs are validated on all ranks of the SP group together before any collective.
        """
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"x": x},
            check=lambda: self.check_inputs(x, timestep, cond, cond_mask, temporal),
            what="Latte1 inputs",
        )
        c = self.config
        _, _, frames, height, width = x.shape
        act = sp.enter(patchify(x, (1, c.patch, c.patch)), SEQ_DIMS, self.STAGES)
        act = self.forward_tokens(act, timestep, cond, cond_mask, sp, (height, width), temporal)
        if not gather_output:
            return act
        return unpatchify(sp.exit(act), (1, c.patch, c.patch), height, width)

    def forward_tokens(
        self,
        act: SeqTensor,
        timestep: torch.Tensor,
        cond: torch.Tensor | None,
        cond_mask: torch.Tensor | None,
        sp: SeqParallel,
        size: tuple[int, int],
        temporal: bool = True,
    ) -> SeqTensor:
        """Sharded patches ``[B, F_l, S_l, p·p·C]`` → sharded output ``[B, F_l, S_l, p·p·C_out]``.

        ``size``: the latent ``(H, W)``. Inputs must already be validated (:meth:`forward`).
        """
        c, x = self.config, act.tensor
        spatial = spatial_table(
            size[0] // c.patch, size[1] // c.patch, c.hidden, c.base_size, c.interpolation_scale
        ).to(device=x.device, dtype=x.dtype)
        act = act.with_tensor(self.x_embed(x) + sp.shard_like(spatial[None, None], act))
        emb = self.t_embed(timestep)  # [B, hidden]
        t_mod = self.t_mod(nn.functional.silu(emb)).unflatten(-1, (6, c.hidden))
        caption = None if cond is None else self.caption(cond)
        frames = act.spec.length("t")
        for i in range(c.depth):
            with comm_region(f"block{i}"):
                act = self.spatial[i](act, t_mod, caption, cond_mask, sp)
                if not temporal:
                    continue
                if i == 0 and frames > 1:
                    table = temporal_table(c.video_length, c.hidden)[None, :, None]
                    table = table.to(device=x.device, dtype=act.tensor.dtype)
                    act = act.with_tensor(act.tensor + sp.shard_like(table, act))
                act = self.temporal[i](act, t_mod, None, None, sp)
        shift, scale = (self.out_table[None] + emb[:, None]).unbind(1)
        out = self.out_proj(modulate(self.norm_out(act.tensor), shift, scale))
        return act.with_tensor(out)


def parameter_count_formula(config: Latte1Config) -> int:
    """Parameters of a Latte-1 model from its config (a cross-check of the module tree)."""
    h, c = config.hidden, config
    bias = h if c.attention_bias else 0
    norm = 2 * h if c.norm_elementwise_affine else 0
    attn = 3 * (h * h + bias) + h * h + h
    mlp = h * 4 * h + 4 * h + 4 * h * h + h
    block = 6 * h + 2 * norm + attn + mlp
    cross = (3 * (h * h + bias) + h * h + h) if c.cross_attention else 0
    embed = (c.in_channels * c.patch**2 + 1) * h
    timestep = 256 * h + h + h * h + h + h * 6 * h + 6 * h
    caption = c.caption_channels * h + h + h * h + h
    out = 2 * h + (h + 1) * c.patch**2 * c.channels_out
    return c.depth * (2 * block + cross) + embed + timestep + caption + out


__all__ = [
    "Latte1",
    "Latte1Block",
    "Latte1Config",
    "parameter_count_formula",
    "spatial_table",
    "temporal_table",
]

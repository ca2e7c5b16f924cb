"""A video Mamba DiT: selective scans over the latent grid ``(t, h, w)`` in configured orders.

Latents ``[B, C, T, H, W]`` become tokens ``[B, T', H', W', pt·ph·pw·C]`` (a pure rearrangement,
so the sequence-parallel split happens on raw patches). Every layer runs, for each scan order of
``config.orders`` (default ``axial(t)``, ``axial(h)``, ``axial(w)``: the DSP-native layout), one
adaLN-modulated, gated, bidirectional Mamba scan as its own stage, then a gated MLP stage;
timestep and class-label conditioning as in DiT (adaLN-Zero: every layer starts as the
identity). The interface is the video DiTs' (:class:`~dspzoo.domains.video.dit.VideoDiT`):
``model(x, timestep, y, sp=sp, gather_output=False, label_drop=...)``, ``patchify_target``,
so the video trainer (``dspzoo train video --model videomamba-tiny``) and sampler take it.

Under DSP an axial order needs nothing but its stage: the plan keeps the scanned dim whole and
switches between the scan axes, as for axial attention. ``raster(t,h,w)`` mixes every dim: its
stage runs a scan method (state passing, head all-to-all) over the sharded outermost dim
through :func:`~.layers.run_scan`. ``cross`` and ``zigzag`` read their dims along route
permutations a shard cannot follow: their stages are ``generic`` and get their dims whole
(``cross(h,w)`` leaves ``t`` free, so DSP shards ``t``; ``zigzag(t,h,w)`` is gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.layers.embeddings import TimestepEmbedder, sincos_1d
from dspzoo.core.layers.mlp import FinalLayer, Mlp, gated, modulate
from dspzoo.core.parallel.context import local, stage

from .layers import OrderedScan, build_mixer, scan_stage
from .orders import parse_order

SEQ_DIMS = ("t", "h", "w")


@dataclass(frozen=True)
class VideoMambaConfig:
    """Architecture of a video Mamba DiT.

    ``orders``: one scan stage per entry, in this order, in every layer (see
    :mod:`.orders`: ``axial(t)``, ``raster(t,h,w)``, ``cross(h,w)``, ``zigzag(t,h,w)`` …).
    ``mixer``: ``mamba1`` or ``mamba2`` (``state_size``, ``expand``, ``conv_kernel``; Mamba-2 also
    ``head_dim`` and ``chunk_size``). ``bidirectional``: each scan runs forwards and backwards
    (a diffusion model sees the whole clip). ``mlp_ratio = 0`` drops the MLP stage.
    The video trainer sets ``in_channels``, ``num_classes``, ``max_frames``, ``input_size`` and
    ``class_dropout_prob``; ``cond_dim`` must stay 0 (no cross-attention).
    """

    in_channels: int = 12
    hidden: int = 64
    depth: int = 2
    patch: tuple[int, int, int] = (1, 2, 2)
    orders: tuple[str, ...] = ("axial(t)", "axial(h)", "axial(w)")
    mixer: str = "mamba2"
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    head_dim: int = 16
    chunk_size: int = 64
    bidirectional: bool = True
    mlp_ratio: float = 2.0
    max_frames: int = 16
    input_size: tuple[int, int] = (16, 16)
    num_classes: int = 0
    class_dropout_prob: float = 0.1
    cond_dim: int = 0
    learn_sigma: bool = False

    @property
    def out_channels(self) -> int:
        """Channels of the model output: ``in_channels``, doubled with ``learn_sigma``."""
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    def mixer_options(self) -> dict:
        """Config fields of one scan direction's mixer."""
        options = dict(
            state_size=self.state_size,
            expand=self.expand,
            conv_kernel=self.conv_kernel,
            bidirectional=self.bidirectional,
        )
        if self.mixer == "mamba2":
            inner = self.expand * self.hidden
            if inner % self.head_dim:
                raise ValueError(
                    f"expand × hidden ({inner}) must be divisible by head_dim {self.head_dim}"
                )
            options.update(num_heads=inner // self.head_dim, head_dim=self.head_dim,
                           chunk_size=self.chunk_size)  # fmt: skip
        return options


def layer_stages(config: VideoMambaConfig) -> tuple[Stage, ...]:
    """The stages of one layer: ``scan{i}`` per order (mixing its dims), then ``mlp``."""
    scans = tuple(scan_stage(f"scan{i}", order) for i, order in enumerate(config.orders))
    return (*scans, Stage("mlp")) if config.mlp_ratio else scans


class VideoMambaBlock(nn.Module):
    """One layer over local tokens ``[B, T'_l, H'_l, W'_l, C]``: a gated scan per order, a
    gated MLP; adaLN shift/scale/gate per branch from the conditioning vector."""

    def __init__(self, config: VideoMambaConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.scans = nn.ModuleList(
            OrderedScan(order, SEQ_DIMS, lambda: build_mixer(c.mixer, c.hidden, **c.mixer_options()), layer)
            for order in c.orders
        )  # fmt: skip
        self.norm = nn.LayerNorm(c.hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(c.hidden, c.mlp_ratio) if c.mlp_ratio else None
        branches = len(self.scans) + (self.mlp is not None)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(c.hidden, 3 * branches * c.hidden))

    def zero_init(self) -> None:
        """adaLN-Zero: zero gates, the block starts as the identity."""
        nn.init.zeros_(self.ada[-1].weight)
        nn.init.zeros_(self.ada[-1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``x`` local ``[B, T'_l, H'_l, W'_l, C]``, ``c`` ``[B, C]`` → same shape as ``x``."""
        mods = self.ada(c).chunk(3 * (len(self.scans) + (self.mlp is not None)), dim=-1)
        for i, scan in enumerate(self.scans):
            shift, scale, gate = mods[3 * i : 3 * i + 3]
            x = stage(f"scan{i}", x)
            x = x + gated(scan(modulate(self.norm(x), shift, scale)), gate)
        if self.mlp is not None:
            shift, scale, gate = mods[-3:]
            x = stage("mlp", x)
            x = x + gated(self.mlp(modulate(self.norm(x), shift, scale)), gate)
        return x


class VideoMamba(nn.Module):
    """Video Mamba DiT; see the module docstring."""

    def __init__(self, config: VideoMambaConfig) -> None:
        super().__init__()
        c = self.config = config
        if c.cond_dim:
            raise ValueError("VideoMamba has no cross-attention: cond_dim must be 0")
        if c.hidden % 2:
            raise ValueError(f"hidden must be even (sin-cos positions), got {c.hidden}")
        for order in c.orders:
            parse_order(order, SEQ_DIMS)  # a clear error for an unknown order or dim
        if not c.orders:
            raise ValueError("orders must name at least one scan order, e.g. ('axial(t)',)")
        self.STAGES = layer_stages(c)
        pt, ph, pw = c.patch
        self.patch_dim = c.in_channels * pt * ph * pw
        self.out_patch_dim = c.out_channels * pt * ph * pw
        if c.hidden < max(self.patch_dim, self.out_patch_dim):
            raise ValueError(
                f"hidden {c.hidden} is narrower than a patch: {self.patch_dim} input and "
                f"{self.out_patch_dim} output values per patch ({c.in_channels} channels, patch "
                f"{tuple(c.patch)}); the final layer could predict only {c.hidden} of them, a "
                f"floor under the flow loss whatever the training. Give hidden >= "
                f"{max(self.patch_dim, self.out_patch_dim)} or a smaller patch"
            )
        self.x_embed = nn.Linear(self.patch_dim, c.hidden)
        self.t_embed = TimestepEmbedder(c.hidden)
        self.y_embed = nn.Embedding(c.num_classes + 1, c.hidden) if c.num_classes else None
        self.blocks = nn.ModuleList(VideoMambaBlock(c, i) for i in range(c.depth))
        self.final = FinalLayer(c.hidden, self.out_patch_dim)
        for block in self.blocks:
            block.zero_init()
        if self.y_embed is not None:
            nn.init.normal_(self.y_embed.weight, std=0.02)
        nn.init.zeros_(self.final.ada[-1].weight)
        nn.init.zeros_(self.final.ada[-1].bias)
        nn.init.zeros_(self.final.linear.weight)
        nn.init.zeros_(self.final.linear.bias)

    # -- inputs --------------------------------------------------------------------------------
    def check_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, y: torch.Tensor | None,
        label_drop: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Raise a clear ``ValueError`` for latents / conditioning this model cannot take."""
        c = self.config
        if x.dim() != 5 or x.shape[1] != c.in_channels:
            raise ValueError(
                f"VideoMamba expects latents [B, C={c.in_channels}, T, H, W], got {tuple(x.shape)}"
            )
        _, _, t, h, w = x.shape
        if t % c.patch[0] or h % c.patch[1] or w % c.patch[2]:
            raise ValueError(
                f"latent size (T={t}, H={h}, W={w}) is not divisible by the patch size {c.patch}"
            )
        if t // c.patch[0] > c.max_frames:
            raise ValueError(f"{t} frames exceed max_frames={c.max_frames} of this model")
        b = x.shape[0]
        if timestep.shape != (b,):
            raise ValueError(f"timestep must be [B={b}], got shape {tuple(timestep.shape)}")
        if y is not None and c.num_classes and y.shape != (b,):
            raise ValueError(f"class labels y must be [B={b}], got shape {tuple(y.shape)}")
        if label_drop is not None and label_drop.shape != (b,):
            raise ValueError(
                f"label_drop must be a [B={b}] boolean mask, got {tuple(label_drop.shape)}"
            )

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, H, W]`` → tokens ``[B, T', H', W', pt·ph·pw·C]``."""
        pt, ph, pw = self.config.patch
        return rearrange(x, "b c (t p) (h q) (w r) -> b t h w (p q r c)", p=pt, q=ph, r=pw)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`patchify` (any channel count)."""
        pt, ph, pw = self.config.patch
        return rearrange(tokens, "b t h w (p q r c) -> b c (t p) (h q) (w r)", p=pt, q=ph, r=pw)

    def patchify_target(self, target: torch.Tensor) -> torch.Tensor:
        """Latent-space target ``[B, C, T, H, W]`` in the output tokens' layout."""
        return self.patchify(target)

    def split_sigma(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output tokens of a ``learn_sigma`` model → (prediction, variance), ``[..., P·C]`` each."""
        if not self.config.learn_sigma:
            raise ValueError("split_sigma: this model was built with learn_sigma=False")
        pred, var = rearrange(
            tokens, "... (p two c) -> two ... (p c)", two=2, c=self.config.in_channels
        )
        return pred, var

    def condition(
        self, timestep: torch.Tensor, y: torch.Tensor | None, label_drop: torch.Tensor | None
    ) -> torch.Tensor:
        """``[B, hidden]`` from timesteps and (optionally dropped) labels; null label for none."""
        c = self.t_embed(timestep)
        if self.y_embed is None:
            return c
        null = torch.full((timestep.shape[0],), self.config.num_classes, device=timestep.device)
        if y is None:
            y = null
        elif label_drop is not None:
            y = torch.where(label_drop.to(device=y.device, dtype=torch.bool), null, y)
        return c + self.y_embed(y)

    def positions(self, t: int, h: int, w: int, like: torch.Tensor) -> torch.Tensor:
        """Sum of sin-cos tables over ``t``, ``h``, ``w``: ``[1, T', H', W', hidden]`` (broadcast)."""
        dim = self.config.hidden
        with torch.device("cpu"):
            pt, ph, pw = sincos_1d(t, dim), sincos_1d(h, dim), sincos_1d(w, dim)
        table = pt[:, None, None] + ph[None, :, None] + pw[None, None, :]
        return table[None].to(device=like.device, dtype=like.dtype)

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        y: torch.Tensor | None = None,
        sp: SeqParallel | None = None,
        gather_output: bool = True,
        label_drop: torch.Tensor | None = None,
    ) -> torch.Tensor | SeqTensor:
        """Predict ``[B, C_out, T, H, W]`` from noisy latents ``x`` at ``timestep`` ``[B]``.

        ``gather_output=False`` returns this rank's output tokens ``[B, T'_l, H'_l, W'_l,
        out_patch_dim]`` as a :class:`SeqTensor` (for a sharded loss against
        :meth:`patchify_target`). Inputs are validated on every rank of the SP group together.
        """
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"x": x},
            check=lambda: self.check_inputs(x, timestep, y, label_drop),
            what="VideoMamba inputs",
        )
        tokens = self.patchify(x)
        _, t, h, w, _ = tokens.shape
        act = sp.enter(tokens, SEQ_DIMS, self.STAGES)
        with sp.region(act) as region:
            hidden = self.x_embed(act.tensor) + local(self.positions(t, h, w, act.tensor))
            c = self.condition(timestep, y, label_drop)
            for i, block in enumerate(self.blocks):
                with comm_region(f"block{i}"):
                    hidden = block(hidden, c)
            act = region.seq(self.final(hidden, c))
        if not gather_output:
            return act
        return self.unpatchify(sp.exit(act))

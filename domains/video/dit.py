"""What every video DiT here shares: config, patching, embeddings, conditioning, final layer.

Latents ``[B, C, T, H, W]`` become tokens ``[B, T', S, C·pt·ph·pw]`` (``T' = T/pt``,
``S = (H/ph)·(W/pw)``) by a pure rearrangement, so the sequence-parallel split happens on raw
patches and the patch embedding (a linear layer, i.e. a strided Conv3d) already runs sharded.
Subclasses supply the blocks and their stage declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from einops import rearrange
from torch import nn

from dspzoo.core import SeqParallel, SeqTensor, Stage, comm_region
from dspzoo.core.layers.embeddings import TimestepEmbedder, sincos_1d, sincos_2d
from dspzoo.core.layers.mlp import FinalLayer
from dspzoo.core.parallel.context import local
from dspzoo.core.parallel.validate import validate_collectively

SEQ_DIMS = ("t", "s")


@dataclass(frozen=True)
class VideoDiTConfig:
    """Architecture of a spatial-temporal video DiT (STDiT and Latte share it).

    ``cond_dim = 0`` builds no cross-attention; ``num_classes = 0`` no label embedding.
    ``max_frames`` bounds the temporal position embedding (in latent frames); the spatial
    tables are built for the actual latent size, ``input_size`` is the default (H, W).
    ``learn_sigma`` doubles the output channels: ``[prediction, variance]`` (DiT/IDDPM style).
    ``full_attention_every = k > 0`` makes every ``k``-th layer attend over all of ``t`` and
    ``s`` at once (full 3-D attention, as full-attention video DiTs do) instead of axially;
    under DSP that stage runs with an embedded method (a hybrid plan). STDiT only.
    """

    in_channels: int = 12
    hidden: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    patch: tuple[int, int, int] = (1, 2, 2)
    max_frames: int = 16
    input_size: tuple[int, int] = (16, 16)
    num_classes: int = 0
    class_dropout_prob: float = 0.1
    cond_dim: int = 0
    learn_sigma: bool = False
    full_attention_every: int = 0

    @property
    def out_channels(self) -> int:
        """Channels of the model output: ``in_channels``, doubled with ``learn_sigma``."""
        return 2 * self.in_channels if self.learn_sigma else self.in_channels


@lru_cache(maxsize=16)
def _sincos_tables(
    frames: int, grid_h: int, grid_w: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed float32 CPU tables: temporal ``[1, T', 1, dim]`` and spatial ``[1, 1, S, dim]``.

    Built on the CPU whatever the default device (a ``torch.device("meta")`` context must not
    leave meta tensors in the cache).
    """
    with torch.device("cpu"):
        return sincos_1d(frames, dim)[None, :, None], sincos_2d(grid_h, grid_w, dim)[None, None]


def frame_local(mod: torch.Tensor, act: SeqTensor, sp: SeqParallel) -> torch.Tensor:
    """This rank's part of a modulation tensor for the activation's current sharding (for
    blocks written against the explicit API; plain-tensor blocks let ``modulate``/``gated``
    slice, see :func:`dspzoo.core.parallel.context.local`).

    ``[B, …, C]`` per-sample tensors pass through; per-frame ones ``[B, T', 1, C]`` are sliced on
    ``t`` when ``act`` is sharded there (in lockstep with the tokens) and kept whole otherwise.
    """
    return sp.shard_like(mod, act) if mod.dim() == 4 else mod


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, T, H, W]`` → ``[B, T/pt, (H/ph)(W/pw), pt·ph·pw·C]``."""
    pt, ph, pw = patch
    return rearrange(x, "b c (t p) (h q) (w r) -> b t (h w) (p q r c)", p=pt, q=ph, r=pw)


def unpatchify(
    tokens: torch.Tensor, patch: tuple[int, int, int], height: int, width: int
) -> torch.Tensor:
    """Inverse of :func:`patchify`; ``height``/``width`` are the latent (not token) sizes."""
    pt, ph, pw = patch
    return rearrange(
        tokens,
        "b t (h w) (p q r c) -> b c (t p) (h q) (w r)",
        h=height // ph,
        w=width // pw,
        p=pt,
        q=ph,
        r=pw,
    )


class VideoDiT(nn.Module):
    """Base class: embeddings, conditioning and the DSP-aware forward.

    Subclasses set ``STAGES``, build ``self.blocks`` and call :meth:`initialize_weights`. The
    blocks run inside the region :meth:`forward_tokens` opens (:mod:`dspzoo.core.parallel.context`) and
    receive plain local tensors: ``block(x, block_inputs(c), context, context_mask) -> x``, with
    ``x = stage(name, x)`` before each stage; per-frame inputs arrive whole (``[B, T', 1, …]``)
    and are sliced for the current layout by ``modulate``/``gated`` (or ``local``).
    """

    STAGES: tuple[Stage, ...] = ()

    def __init__(self, config: VideoDiTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        if c.hidden % c.heads:
            raise ValueError(f"hidden {c.hidden} is not divisible by heads {c.heads}")
        if c.hidden % 4:
            raise ValueError(
                f"hidden {c.hidden} must be divisible by 4 for the 2-D sin-cos position embedding"
            )
        self.patch_dim = c.in_channels * c.patch[0] * c.patch[1] * c.patch[2]
        self.x_embed = nn.Linear(self.patch_dim, c.hidden)
        self.t_embed = TimestepEmbedder(c.hidden)
        self.y_embed = nn.Embedding(c.num_classes + 1, c.hidden) if c.num_classes else None
        self.cond_proj = (
            nn.Sequential(
                nn.Linear(c.cond_dim, c.hidden),
                nn.GELU(approximate="tanh"),
                nn.Linear(c.hidden, c.hidden),
            )
            if c.cond_dim
            else None
        )
        self.out_patch_dim = c.out_channels * c.patch[0] * c.patch[1] * c.patch[2]
        self.final = FinalLayer(c.hidden, self.out_patch_dim)

    # -- init -----------------------------------------------------------------------------
    def initialize_weights(self) -> None:
        """Xavier linears, small embeddings, and adaLN-Zero: every block starts as the identity.

        Blocks implement ``zero_init()`` (zero gates and zero output projections of ungated
        branches); the final layer starts at zero, so the initial prediction is 0.
        """

        def init(m: nn.Module) -> None:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

        self.apply(init)
        if self.y_embed is not None:
            nn.init.normal_(self.y_embed.weight, std=0.02)
        for m in self.t_embed.mlp:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for module in self.modules():
            if hasattr(module, "zero_init"):
                module.zero_init()
        nn.init.zeros_(self.final.ada[-1].weight)
        nn.init.zeros_(self.final.ada[-1].bias)
        nn.init.zeros_(self.final.linear.weight)
        nn.init.zeros_(self.final.linear.bias)

    # -- inputs ---------------------------------------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error for latents this model cannot take."""
        c = self.config
        if x.dim() != 5:
            raise ValueError(
                f"{type(self).__name__} expects latents [B, C, T, H, W], got shape {tuple(x.shape)}"
            )
        if x.shape[1] != c.in_channels:
            raise ValueError(
                f"expected {c.in_channels} latent channels, got {x.shape[1]} (shape {tuple(x.shape)})"
            )
        _, _, t, h, w = x.shape
        pt, ph, pw = c.patch
        if t % pt or h % ph or w % pw:
            raise ValueError(
                f"latent size (T={t}, H={h}, W={w}) is not divisible by the patch size {c.patch}"
            )
        if t // pt > c.max_frames:
            raise ValueError(
                f"{t} frames is beyond the position-embedding range of this model (max_frames={c.max_frames}); "
                f"use fewer frames or a config with a larger max_frames"
            )

    def check_conditioning(
        self,
        batch: int,
        timestep: torch.Tensor,
        y: torch.Tensor | None,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        frames: int | None = None,
        label_drop: torch.Tensor | None = None,
    ) -> None:
        """Raise a clear error for timesteps / labels / conditioning tokens of the wrong shape.

        ``frames``: token frames ``T'`` of the input, the length per-frame timesteps must have.
        """
        c = self.config
        if timestep.shape != (batch,) and (frames is None or timestep.shape != (batch, frames)):
            per_frame = "" if frames is None else f" or per frame [B={batch}, T'={frames}]"
            raise ValueError(
                f"timestep must be [B={batch}]{per_frame}, got shape {tuple(timestep.shape)}"
            )
        if y is not None and c.num_classes and y.shape != (batch,):
            raise ValueError(f"class labels y must be [B={batch}], got shape {tuple(y.shape)}")
        if label_drop is not None and label_drop.shape != (batch,):
            raise ValueError(
                f"label_drop must be a [B={batch}] boolean mask, got shape {tuple(label_drop.shape)}"
            )
        if context is None:
            if context_mask is not None:
                raise ValueError("cond_mask given without conditioning tokens cond")
            return
        if self.cond_proj is None:
            raise ValueError(
                "this model was built without cross-attention (cond_dim=0) but got conditioning tokens"
            )
        if context.dim() != 3 or context.shape[0] != batch or context.shape[-1] != c.cond_dim:
            raise ValueError(
                f"conditioning tokens must be [B={batch}, L, cond_dim={c.cond_dim}], "
                f"got shape {tuple(context.shape)}"
            )
        if context_mask is not None and context_mask.shape != context.shape[:2]:
            raise ValueError(
                f"cond_mask must be [B, L] = {tuple(context.shape[:2])}, got {tuple(context_mask.shape)}"
            )

    def position_tables(
        self, frames: int, height: int, width: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Temporal ``[1, T', 1, hidden]`` and spatial ``[1, 1, S, hidden]`` sin-cos tables.

        ``frames`` counts token frames, ``height``/``width`` are latent sizes. Kept separate
        (broadcast when added) so no ``[T', S, hidden]`` table is ever materialised.
        """
        c = self.config
        temporal, spatial = _sincos_tables(
            frames, height // c.patch[1], width // c.patch[2], c.hidden
        )
        return temporal.to(device=device, dtype=dtype), spatial.to(device=device, dtype=dtype)

    def condition(
        self,
        timestep: torch.Tensor,
        y: torch.Tensor | None,
        label_drop: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Conditioning vector from timesteps and (optionally dropped) class labels.

        ``timestep`` ``[B]`` gives ``[B, hidden]``; per-frame timesteps ``[B, T']`` (e.g. clean
        conditioning frames at t = 0 next to noisy ones) give ``[B, T', 1, hidden]``, laid out to
        broadcast over ``[B, T', S, hidden]`` tokens and sliced with them (:func:`~dspzoo.core.parallel.context.local`).

        Label dropout for classifier-free guidance: ``label_drop`` ``[B]`` bool replaces the
        marked labels with the null label. Trainers pass it drawn from keyed randomness
        (:class:`dspzoo.core.parallel.rng.SampleRandom`), which makes the run independent of the
        dp × sp layout. Without it, a model in training mode with ``class_dropout_prob > 0``
        draws the mask from the global RNG (fine for one process, or with the global RNG
        seeded identically inside each SP group by :func:`dspzoo.core.seed_everything`).
        """
        c = self.t_embed(timestep.flatten()).unflatten(0, timestep.shape)
        if timestep.dim() == 2:
            c = c[:, :, None]
        if self.y_embed is not None:
            if y is None:
                y = torch.full(
                    (timestep.shape[0],),
                    self.config.num_classes,
                    dtype=torch.long,
                    device=timestep.device,
                )
            else:
                if label_drop is None and self.training and self.config.class_dropout_prob > 0:
                    label_drop = torch.rand(y.shape[0]) < self.config.class_dropout_prob
                if label_drop is not None:
                    null = torch.full_like(y, self.config.num_classes)
                    y = torch.where(label_drop.to(device=y.device, dtype=torch.bool), null, y)
            label = self.y_embed(y)
            c = c + (label[:, None, None] if c.dim() == 4 else label)
        return c

    def block_inputs(self, c: torch.Tensor) -> torch.Tensor:
        """What every block receives as its modulation input (default: ``c`` itself)."""
        return c

    def patchify_target(self, target: torch.Tensor) -> torch.Tensor:
        """Latent-space target ``[B, C, T, H, W]`` → ``[B, T', S, pt·ph·pw·C]``, the output's layout.

        With ``learn_sigma`` compare it with the first half of :meth:`split_sigma`.
        """
        return patchify(target, self.config.patch)

    def split_sigma(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output tokens ``[..., P·2C]`` of a ``learn_sigma`` model → (prediction, variance).

        Each is ``[..., P·C]`` in the layout of :meth:`patchify_target` (``P = pt·ph·pw``).
        """
        if not self.config.learn_sigma:
            raise ValueError("split_sigma: this model was built with learn_sigma=False")
        pred, var = rearrange(
            tokens, "... (p two c) -> two ... (p c)", two=2, c=self.config.in_channels
        )
        return pred, var

    # -- forward --------------------------------------------------------------------------
    def forward_tokens(
        self,
        act: SeqTensor,
        timestep: torch.Tensor,
        y: torch.Tensor | None,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        sp: SeqParallel,
        grid: tuple[int, int, int],
        label_drop: torch.Tensor | None = None,
    ) -> SeqTensor:
        """Sharded raw patches ``[B, T'_l, S_l, patch_dim]`` → output ``[B, T'_l, S_l, out_patch_dim]``.

        ``grid`` is the latent ``(T, H, W)``. The output is sharded on the plan's last stage dim
        (``out_patch_dim = pt·ph·pw·out_channels``). The conditioning is validated on every
        rank of the SP group together: a bad input on one rank raises on all of them.
        """
        batch = act.tensor.shape[0]
        validate_collectively(
            lambda: self.check_conditioning(
                batch, timestep, y, context, context_mask, act.spec.length("t"), label_drop
            ),
            sp.group,
            f"{type(self).__name__} conditioning",
            act.tensor.device,
        )
        return self._forward_tokens(act, timestep, y, context, context_mask, sp, grid, label_drop)

    def _forward_tokens(
        self,
        act: SeqTensor,
        timestep: torch.Tensor,
        y: torch.Tensor | None,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        sp: SeqParallel,
        grid: tuple[int, int, int],
        label_drop: torch.Tensor | None,
    ) -> SeqTensor:
        """:meth:`forward_tokens` on inputs already validated."""
        with sp.region(act) as region:
            x = act.tensor
            temporal, spatial = self.position_tables(
                grid[0] // self.config.patch[0], grid[1], grid[2], x.device, x.dtype
            )
            x = self.x_embed(x) + local(temporal) + local(spatial)
            c = self.condition(timestep, y, label_drop)
            if context is not None:
                context = self.cond_proj(context)
            block_c = self.block_inputs(c)
            for i, block in enumerate(self.blocks):
                with comm_region(f"block{i}"):
                    x = block(x, block_c, context, context_mask)
            return region.seq(self.final(x, c))

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        y: torch.Tensor | None = None,
        cond: torch.Tensor | None = None,
        cond_mask: torch.Tensor | None = None,
        sp: SeqParallel | None = None,
        gather_output: bool = True,
        label_drop: torch.Tensor | None = None,
    ) -> torch.Tensor | SeqTensor:
        """Predict ``[B, C_out, T, H, W]`` from noisy latents ``x`` at ``timestep`` ``[B]``.

        ``C_out = config.out_channels`` (``2·C`` with ``learn_sigma``, see :meth:`split_sigma`).

        Args:
            y: class labels ``[B]`` (``None``: unconditional / the null label).
            cond: conditioning tokens ``[B, L, cond_dim]`` for cross-attention, replicated.
            cond_mask: ``[B, L]`` bool, True for real tokens.
            sp: the sequence-parallel context (``None``: one process).
            gather_output: return the replicated output; otherwise this rank's shard in token
                layout ``[B, T'_l, S_l, out_patch_dim]`` as a :class:`SeqTensor` (for a sharded loss
                against :meth:`patchify_target`).
            label_drop: ``[B]`` bool, labels to replace with the null label (see :meth:`condition`).

        Every input is validated on all ranks of the SP group together before any collective:
        a bad input on one rank raises the same clear error on every rank instead of a hang.
        """
        sp = sp or SeqParallel()

        def check() -> None:
            self.check_input(x)
            frames = x.shape[2] // self.config.patch[0]
            self.check_conditioning(x.shape[0], timestep, y, cond, cond_mask, frames, label_drop)

        sp.agree_entry({"x": x}, check=check, what=f"{type(self).__name__} inputs")
        _, _, t, h, w = x.shape
        act = sp.enter(patchify(x, self.config.patch), SEQ_DIMS, self.STAGES)
        act = self._forward_tokens(act, timestep, y, cond, cond_mask, sp, (t, h, w), label_drop)
        if not gather_output:
            return act
        return unpatchify(sp.exit(act), self.config.patch, h, w)

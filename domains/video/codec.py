"""Pixels ↔ latents. The models' interface is latents ``[B, C, T, H, W]``.

:class:`PixelUnshuffleCodec` is the built-in, exactly invertible, parameter-free "autoencoder":
each ``f × f`` pixel block becomes ``3·f²`` latent channels (a space-to-depth), so a 32 × 32 RGB
clip is a 12-channel 16 × 16 latent. It keeps CPU training small without a learned VAE; a learned
autoencoder can replace it with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange


@dataclass(frozen=True)
class PixelUnshuffleCodec:
    """Space-to-depth by ``factor`` on H and W: ``[B, 3, T, H, W]`` ↔ ``[B, 3·f², T, H/f, W/f]``."""

    factor: int = 2
    pixel_channels: int = 3

    @property
    def latent_channels(self) -> int:
        return self.pixel_channels * self.factor**2

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, 3, T, H, W]`` in [-1, 1] → latents ``[B, 3·f², T, H/f, W/f]``."""
        if video.dim() != 5 or video.shape[1] != self.pixel_channels:
            raise ValueError(
                f"encode expects [B, {self.pixel_channels}, T, H, W] pixels, got {tuple(video.shape)}"
            )
        f = self.factor
        if video.shape[-1] % f or video.shape[-2] % f:
            raise ValueError(
                f"frame size {tuple(video.shape[-2:])} is not divisible by the codec factor {f}"
            )
        return rearrange(video, "b c t (h p) (w q) -> b (c p q) t h w", p=f, q=f)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 3·f², T, h, w]`` → pixels ``[B, 3, T, h·f, w·f]``."""
        if latents.dim() != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"decode expects [B, {self.latent_channels}, T, h, w] latents, got {tuple(latents.shape)}"
            )
        f = self.factor
        return rearrange(latents, "b (c p q) t h w -> b c t (h p) (w q)", p=f, q=f)

"""Rectified-flow objective and Euler sampler for video latents ``[B, C, T, H, W]``.

Interpolation ``x_t = (1 − t)·x_0 + t·ε`` between data ``x_0`` (t = 0) and noise ``ε`` (t = 1);
the model predicts the velocity ``v = ε − x_0`` from ``x_t`` and ``1000·t``. Sampling
(:mod:`.sampling`) integrates from t = 1 to t = 0 with Euler steps.

Noise and timesteps are drawn from a caller-given generator (or the global RNG): under SP they
must be identical on every rank of a group, which :func:`dspzoo.core.seed_everything` ensures
for the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIMESTEP_SCALE = 1000.0


@dataclass(frozen=True)
class FlowConfig:
    """Training-time sampling of t: logit-normal (``logit_normal=True``) or uniform."""

    logit_normal: bool = True
    logit_mean: float = 0.0
    logit_std: float = 1.0


def sample_t(batch: int, cfg: FlowConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Training timesteps in (0, 1), shape ``[batch]``."""
    if cfg.logit_normal:
        z = torch.randn(batch, generator=generator) * cfg.logit_std + cfg.logit_mean
        return torch.sigmoid(z)
    return torch.rand(batch, generator=generator)


def noisy_pair(
    x0: torch.Tensor, t: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v)`` for data ``x0`` ``[B, C, T, H, W]`` and timesteps ``t`` ``[B]``."""
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    tt = t.to(x0.device, x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise, noise - x0

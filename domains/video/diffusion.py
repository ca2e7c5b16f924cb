"""Rectified-flow objective and Euler sampler for video latents ``[B, C, T, H, W]``.

Interpolation ``x_t = (1 − t)·x_0 + t·ε`` between data ``x_0`` (t = 0) and noise ``ε`` (t = 1);
the model predicts the velocity ``v = ε − x_0`` from ``x_t`` and ``1000·t``. Sampling
(:mod:`.sampling`) integrates from t = 1 to t = 0 with Euler steps.

Training draws (noise, timesteps) are keyed by ``(seed, step, sample)`` through
:class:`dspzoo.core.parallel.rng.SampleRandom` (:func:`keyed_t`, ``noisy_pair(..., noise=...)``), so they
are identical on every rank of an SP group and independent of the dp × sp layout. A generator
(or the global RNG) can be passed instead for ad-hoc use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspzoo.core.parallel.rng import SampleRandom

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


def keyed_t(random: SampleRandom, cfg: FlowConfig) -> torch.Tensor:
    """Training timesteps ``[B]`` in (0, 1), one per sample, keyed by (seed, step, sample)."""
    if cfg.logit_normal:
        return torch.sigmoid(random.randn("timestep") * cfg.logit_std + cfg.logit_mean)
    return random.rand("timestep")


def noisy_pair(
    x0: torch.Tensor,
    t: torch.Tensor,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v)`` for data ``x0`` ``[B, C, T, H, W]`` and timesteps ``t`` ``[B]``.

    ``noise`` (same shape as ``x0``) is used when given, else drawn from ``generator``.
    """
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
    elif noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} differs from data {tuple(x0.shape)}")
    noise = noise.to(device=x0.device, dtype=x0.dtype)
    tt = t.to(x0.device, x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise, noise - x0

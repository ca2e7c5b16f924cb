"""Rectified-flow objective and Euler sampler for video latents ``[B, C, T, H, W]``.

Interpolation ``x_t = (1 − t)·x_0 + t·ε`` between data ``x_0`` (t = 0) and noise ``ε`` (t = 1);
the model predicts the velocity ``v = ε − x_0`` from ``x_t`` and ``1000·t``. Sampling integrates
from t = 1 to t = 0 with Euler steps, with optional classifier-free guidance on class labels.

Noise and timesteps are drawn from a caller-given generator (or the global RNG): under SP they
must be identical on every rank of a group, which :func:`dspzoo.core.seed_everything` ensures
for the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

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


VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@torch.no_grad()
def euler_sample(
    velocity: VelocityFn,
    shape: tuple[int, ...],
    steps: int,
    labels: torch.Tensor | None = None,
    null_label: int | None = None,
    guidance: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> torch.Tensor:
    """Integrate dx/dt = v from pure noise at t = 1 down to t = 0.

    Args:
        velocity: ``velocity(x_t, timestep_scaled [B], labels)`` → ``[B, C, T, H, W]``.
        shape: ``(B, C, T, H, W)``.
        steps: Euler steps.
        labels: class labels ``[B]`` or ``None``.
        null_label: the "no class" label for classifier-free guidance.
        guidance: CFG scale (1 = off). With guidance the batch is doubled (cond, uncond).
    """
    x = torch.randn(shape, generator=generator).to(device)
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in tqdm(range(steps), desc="sampling", disable=not progress, leave=False):
        t, t_next = float(ts[i]), float(ts[i + 1])
        tvec = torch.full((shape[0],), t * TIMESTEP_SCALE, device=device)
        if guidance != 1.0 and labels is not None and null_label is not None:
            both = velocity(
                torch.cat([x, x]),
                torch.cat([tvec, tvec]),
                torch.cat([labels, torch.full_like(labels, null_label)]),
            )
            cond, uncond = both.chunk(2)
            v = uncond + guidance * (cond - uncond)
        else:
            v = velocity(x, tvec, labels)
        x = x + (t_next - t) * v
    return x

"""Euler sampling of a video DiT with the latents sharded across the SP group.

The noise is drawn identically on every rank (same seed), entered into the sharded region
once, and stays sharded for all steps: each step is one forward of the model on local tokens
plus one switch bringing the predicted velocity back to the state's sharded dim. Only the
final latents are gathered. :func:`euler_flow` is the Euler loop itself (classifier-free
guidance included), which the video Mamba DiT's sampler runs too
(:mod:`dspzoo.domains.mamba.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspzoo.core import SeqParallel
from dspzoo.core.progress import progress_bar

from .diffusion import TIMESTEP_SCALE
from .dit import SEQ_DIMS, VideoDiT, patchify, unpatchify


@dataclass
class SampleResult:
    """Replicated latents ``[B, C, T, H, W]`` and the wall time per phase (seconds)."""

    latents: torch.Tensor
    seconds: float
    seconds_per_step: float


def initial_noise(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The starting latents: drawn on the CPU from ``seed``, so every rank (and every device
    type) starts alike, then moved to ``device``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def guided_labels(labels: torch.Tensor, null_label: int) -> torch.Tensor:
    """``[2B]`` labels of the doubled classifier-free-guidance batch: ``labels``, then the
    null label for the unconditional half."""
    return torch.cat([labels, torch.full_like(labels, null_label)])


def euler_flow(
    x: torch.Tensor,
    velocity: Callable[[torch.Tensor, float], torch.Tensor],
    steps: int,
    guidance: float = 1.0,
    use_cfg: bool = False,
    progress: bool = True,
) -> torch.Tensor:
    """Integrate the learned velocity from noise (t = 1) to data (t = 0): ``steps`` Euler steps
    ``x ← x + dt · v(x, t)`` over ``t = 1, 1 − 1/steps, …``, the samplers' one loop.

    ``x``: the state, any shape ``[B, ...]`` (the DiTs' local tokens, the Mamba DiT's whole
    latents). ``velocity(x_in, t)``: the model's velocity for ``x_in`` at ``t`` (same shape; with
    ``use_cfg`` ``x_in`` is ``[x; x]``, ``[2B, ...]``, the conditional branch first, and the
    result is ``v_uncond + guidance · (v_cond − v_uncond)``).
    """
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in progress_bar(range(steps), desc="sampling", disable=not progress, leave=False):
        t, dt = float(ts[i]), float(ts[i + 1] - ts[i])
        v = velocity(torch.cat([x, x]) if use_cfg else x, t)
        if use_cfg:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + guidance * (v_cond - v_uncond)
        x = x + dt * v
    return x


@torch.no_grad()
def sample_video(
    model: VideoDiT,
    sp: SeqParallel,
    shape: tuple[int, int, int, int, int],
    steps: int = 30,
    labels: torch.Tensor | None = None,
    guidance: float = 1.0,
    cond: torch.Tensor | None = None,
    cond_mask: torch.Tensor | None = None,
    seed: int = 0,
    progress: bool = True,
) -> SampleResult:
    """Integrate the learned velocity from noise (t = 1) to data (t = 0) (:func:`euler_flow`).

    Args:
        shape: latent shape ``(B, C, T, H, W)``.
        labels: class labels ``[B]``; with ``guidance != 1`` classifier-free guidance runs the
            conditional and unconditional (null label) branches in one doubled batch.
    """
    model.check_input(torch.empty(shape, device="meta"))
    start = time.perf_counter()
    device = next(model.parameters()).device
    noise = initial_noise(shape, seed, device)
    batch, _, frames, height, width = shape
    grid = (frames, height, width)
    x = sp.enter(patchify(noise, model.config.patch), SEQ_DIMS, model.STAGES)
    use_cfg = guidance != 1.0 and labels is not None
    labels = None if labels is None else labels.to(device)
    cond = None if cond is None else cond.to(device)
    cond_mask = None if cond_mask is None else cond_mask.to(device)
    if use_cfg:
        labels_in = guided_labels(labels, model.config.num_classes)
        cond_in = None if cond is None else torch.cat([cond, cond])
        mask_in = None if cond_mask is None else torch.cat([cond_mask, cond_mask])
    else:
        labels_in, cond_in, mask_in = labels, cond, cond_mask

    def velocity(tokens: torch.Tensor, t: float) -> torch.Tensor:
        """The velocity of the local tokens, back on the state's sharded dim."""
        tvec = torch.full((tokens.shape[0],), t * TIMESTEP_SCALE, device=device)
        v = model.forward_tokens(x.with_tensor(tokens), tvec, labels_in, cond_in, mask_in, sp, grid)
        v = sp.switch(v, x.spec.sharded).tensor
        if model.config.learn_sigma:  # the variance half plays no part in a flow ODE
            v = model.split_sigma(v)[0]
        return v

    tokens = euler_flow(x.tensor, velocity, steps, guidance, use_cfg, progress)
    latents = unpatchify(sp.exit(x.with_tensor(tokens)), model.config.patch, height, width)
    seconds = time.perf_counter() - start
    return SampleResult(latents=latents, seconds=seconds, seconds_per_step=seconds / max(1, steps))

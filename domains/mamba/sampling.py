"""Sampling and evaluating the video Mamba DiT: the video domain's Euler sampler and metrics.

:func:`sample_video` integrates the learned velocity from noise (t = 1) to data (t = 0) with
the video domain's Euler loop (:func:`dspzoo.domains.video.sampling.euler_flow`: the same noise
from ``seed``, the same steps, classifier-free guidance with the null label), calling
:meth:`VideoMamba.forward` each step: under SP the model shards the tokens itself and returns
the replicated velocity, so every rank of the group holds the same latents. :func:`evaluate`
gives the video model card's figures (:mod:`dspzoo.domains.video.evaluation`) with this sampler.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dspzoo.core import SeqParallel
from dspzoo.domains.video.diffusion import TIMESTEP_SCALE
from dspzoo.domains.video.evaluation import heldout_flow_loss, sample_metrics
from dspzoo.domains.video.sampling import SampleResult, euler_flow, guided_labels, initial_noise

from ...core.errors import UsageError
from .video import VideoMamba


@torch.no_grad()
def sample_video(
    model: VideoMamba,
    sp: SeqParallel,
    shape: tuple[int, int, int, int, int],
    steps: int = 30,
    labels: torch.Tensor | None = None,
    guidance: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> SampleResult:
    """Replicated latents ``shape`` = ``(B, C, T, H, W)`` after ``steps`` Euler steps.

    ``labels`` ``[B]``: class labels; with ``guidance != 1`` the conditional and unconditional
    (null label) branches run in one doubled batch.
    """
    if steps < 1:
        raise UsageError(f"steps must be >= 1, got {steps}")
    if labels is not None and labels.shape != (shape[0],):
        raise ValueError(f"labels must be [B={shape[0]}], got {tuple(labels.shape)}")
    start = time.perf_counter()
    device = next(model.parameters()).device
    x = initial_noise(shape, seed, device)
    use_cfg = guidance != 1.0 and labels is not None and model.config.num_classes > 0
    labels = None if labels is None or not model.config.num_classes else labels.to(device)
    labels_in = guided_labels(labels, model.config.num_classes) if use_cfg else labels
    channels = shape[1]

    def velocity(latents: torch.Tensor, t: float) -> torch.Tensor:
        """The replicated velocity ``[B, C, T, H, W]`` in fp32 (guidance combined in fp32)."""
        tvec = torch.full((latents.shape[0],), t * TIMESTEP_SCALE, device=device)
        v = model(latents, tvec, labels_in, sp=sp)[:, :channels]  # learn_sigma: velocity half
        return v.float()

    x = euler_flow(x, velocity, steps, guidance, use_cfg, progress)
    seconds = time.perf_counter() - start
    return SampleResult(latents=x, seconds=seconds, seconds_per_step=seconds / steps)


def evaluate(model: VideoMamba, settings: dict[str, Any]) -> dict[str, float]:
    """Every figure of a video Mamba DiT's model card: the video domain's held-out flow loss,
    palette fidelity and colour stability, measured as for ``stdit-mini-shapes``."""
    return {"heldout_flow_loss": heldout_flow_loss(model, settings)} | sample_metrics(
        model, settings, sampler=sample_video
    )

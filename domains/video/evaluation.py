"""How good a trained video model is, in numbers a model card can record and a test recompute.

Two figures, both deterministic (fixed seeds, one process):

* ``heldout_flow_loss``: the rectified-flow training objective on clips the model never saw
  (the moving-shapes generator at another seed), averaged over a fixed grid of timesteps with
  fixed noise — the same loss the training curve shows, but held out and noise-free in its
  sampling.
* ``palette_fidelity``: the share of pixels of sampled clips whose colour is within 0.25 (on
  the [-1, 1] scale, per channel) of the background or one of the data's palette colours.
  Clean, flat-coloured shapes score near 1; the ragged, colour-drifting blobs of an
  under-trained model score far lower (an untrained model scores near 0).
* ``colour_stability``: 1 − the mean (over sampled clips) of the frame-to-frame change of the
  foreground's mean colour, so a shape keeping its colour while it moves scores near 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspzoo.core import SeqParallel

from .codec import PixelUnshuffleCodec
from .data import PALETTE, MovingShapesConfig, MovingShapesDataset
from .diffusion import TIMESTEP_SCALE, noisy_pair
from .dit import VideoDiT
from .sampling import SampleResult, sample_video

HELDOUT_SEED = 1_000_003  # the generator seed of the held-out clips (training uses seed 0)
TOLERANCE = 0.25


@torch.no_grad()
def heldout_flow_loss(
    model: VideoDiT,
    settings: dict[str, Any],
    clips: int = 16,
    timesteps: int = 4,
    seed: int = 0,
) -> float:
    """Mean rectified-flow MSE on ``clips`` held-out clips at ``timesteps`` evenly spaced t."""
    codec = PixelUnshuffleCodec(settings.get("codec_factor", 2))
    data = MovingShapesDataset(
        MovingShapesConfig(
            num_samples=clips,
            frames=settings["frames"],
            height=settings["size"],
            width=settings["size"],
            seed=HELDOUT_SEED,
        )
    )
    batch = [data[i] for i in range(clips)]
    device = next(model.parameters()).device  # the clips go where the model is (a GPU too)
    x0 = codec.encode(torch.stack([b["video"] for b in batch])).to(device)
    labels = torch.stack([b["label"] for b in batch]).to(device)
    generator = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same on any device
    model.eval()
    total = 0.0
    for t_value in torch.linspace(0.05, 0.95, timesteps).tolist():
        t = torch.full((clips,), t_value, device=device)
        noise = torch.randn(x0.shape, generator=generator)
        xt, velocity = noisy_pair(x0, t, noise=noise)
        out = model(xt, t * TIMESTEP_SCALE, y=labels, sp=SeqParallel())
        if model.config.learn_sigma:
            out = out[:, : velocity.shape[1]]
        total += torch.mean((out.float() - velocity) ** 2).item()
    return total / timesteps


def palette_fidelity(video: torch.Tensor, background: float = -0.8) -> float:
    """Share of pixels of ``video`` ``[B, 3, T, H, W]`` (in [-1, 1]) near an allowed colour."""
    allowed = torch.cat(
        [torch.full((1, 3), background), torch.from_numpy(PALETTE) * 2 - 1]
    )  # [K, 3]
    pixels = video.permute(0, 2, 3, 4, 1).reshape(-1, 3)  # [P, 3]
    distance = (pixels[:, None, :] - allowed[None]).abs().amax(-1)  # [P, K]
    return (distance.amin(-1) <= TOLERANCE).float().mean().item()


def colour_stability(video: torch.Tensor, background: float = -0.8) -> float:
    """1 − mean frame-to-frame change of the foreground mean colour (``[B, 3, T, H, W]``)."""
    foreground = ((video - background).abs().amax(1, keepdim=True) > TOLERANCE).float()
    area = foreground.sum((-1, -2)).clamp_min(1.0)  # [B, 1, T]
    mean_colour = (video * foreground).sum((-1, -2)) / area  # [B, 3, T]
    change = (mean_colour[..., 1:] - mean_colour[..., :-1]).abs().amax(1)  # [B, T-1]
    return 1.0 - change.mean().item() / 2.0  # colours span [-1, 1]: a change of 2 is total


@torch.no_grad()
def sample_metrics(
    model: torch.nn.Module,
    settings: dict[str, Any],
    per_class: int = 1,
    steps: int = 20,
    guidance: float = 3.0,
    seed: int = 0,
    sampler: Callable[..., SampleResult] = sample_video,
) -> dict[str, float]:
    """``palette_fidelity`` and ``colour_stability`` of seeded samples, one process.

    ``sampler``: the model family's Euler sampler with :func:`~.sampling.sample_video`'s
    signature (the video Mamba DiT passes its own)."""
    codec = PixelUnshuffleCodec(settings.get("codec_factor", 2))
    classes = max(1, model.config.num_classes)
    labels = torch.arange(classes).repeat_interleave(per_class)
    latent = settings["size"] // codec.factor
    shape = (len(labels), model.config.in_channels, settings["frames"], latent, latent)
    result = sampler(
        model,
        SeqParallel(),
        shape,
        steps=steps,
        labels=labels if model.config.num_classes else None,
        guidance=guidance,
        seed=seed,
        progress=False,
    )
    video = codec.decode(result.latents.float().cpu()).clamp(-1, 1)
    return {
        "palette_fidelity": palette_fidelity(video),
        "colour_stability": colour_stability(video),
    }


def evaluate(model: VideoDiT, settings: dict[str, Any]) -> dict[str, float]:
    """Every figure of the model card (tens of seconds on two CPU cores for ``stdit-mini``)."""
    return {"heldout_flow_loss": heldout_flow_loss(model, settings)} | sample_metrics(
        model, settings
    )

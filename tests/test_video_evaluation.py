"""The video model card's figures: what they score on real data, on noise, and their determinism."""

from __future__ import annotations

import pytest
import torch

import dspzoo.domains.video  # noqa: F401  (registers stdit)
from dspzoo.domains.video.data import MovingShapesConfig, MovingShapesDataset
from dspzoo.domains.video.evaluation import (
    colour_stability,
    heldout_flow_loss,
    palette_fidelity,
)
from dspzoo.zoo import create_model

SETTINGS = {"frames": 4, "size": 16, "codec_factor": 2}


def _clips(n: int = 6) -> torch.Tensor:
    data = MovingShapesDataset(MovingShapesConfig(num_samples=n, frames=4, height=16, width=16))
    return torch.stack([data[i]["video"] for i in range(n)])


def test_data_scores_perfectly_and_noise_does_not() -> None:
    clips = _clips()
    assert palette_fidelity(clips) == 1.0
    assert colour_stability(clips) == pytest.approx(1.0, abs=1e-6)
    noise = torch.rand(clips.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert palette_fidelity(noise) < 0.2
    drifting = clips.clone()
    fg = (clips - -0.8).abs().amax(1, keepdim=True) > 0.25
    drifting[:, :, 1::2] = torch.where(fg[:, :, 1::2], -clips[:, :, 1::2], clips[:, :, 1::2])
    assert colour_stability(drifting) < 0.9  # the colour flips every other frame


def test_heldout_loss_is_deterministic_and_untrained_models_score_above_one() -> None:
    torch.manual_seed(0)
    model = create_model("stdit-tiny", in_channels=12, num_classes=4, input_size=(8, 8), cond_dim=0)
    first = heldout_flow_loss(model, SETTINGS, clips=4, timesteps=2)
    assert first == heldout_flow_loss(model, SETTINGS, clips=4, timesteps=2)
    # the untrained model predicts ~0: the loss is about E|v|^2 = E|eps - x0|^2 (> 1)
    assert first > 1.0

"""Parameter EMA."""

from __future__ import annotations

import pytest
import torch

from dspzoo.core.train.ema import EMA


def test_ema_tracks_and_restores() -> None:
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.5)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)  # warm-up decay min(0.5, 2/11) = 2/11
    expected = start + (1 - 2 / 11) * 1.0
    torch.testing.assert_close(ema.shadow["weight"], expected)
    state = ema.state_dict()
    other = EMA(model, decay=0.9)
    other.load_state_dict(state)
    assert other.updates == 1 and other.decay == 0.5
    other.copy_to(model)
    torch.testing.assert_close(model.weight, expected)
    with pytest.raises(ValueError, match="decay"):
        EMA(model, decay=1.0)


def test_ema_load_moves_the_averages_to_the_parameters_device() -> None:
    """A checkpoint restored with ``map_location="cpu"`` (as Accelerate does) must not leave the
    averages on the CPU when the model lives elsewhere (CUDA in practice; "meta" here)."""
    cpu_model = torch.nn.Linear(3, 2)
    state = EMA(cpu_model).state_dict()
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    ema = EMA(model)
    ema.load_state_dict(state)
    assert all(v.device.type == "meta" for v in ema.shadow.values())
    with pytest.raises(ValueError, match="unknown parameters"):
        ema.load_state_dict({**state, "shadow": {**state["shadow"], "extra": torch.zeros(1)}})

"""Exponential moving average of parameters (the weights diffusion models are sampled with)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EMA:
    """Keeps ``shadow = d·shadow + (1 − d)·param`` after every update.

    The decay warms up as ``min(decay, (1 + n) / (10 + n))`` so early averages are not dominated
    by the random initialisation. Has ``state_dict``/``load_state_dict`` for
    ``accelerator.register_for_checkpointing``. Parameters must be plain (replicated) tensors,
    as under DDP; all ranks then hold identical averages.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, p in model.named_parameters():
            self.shadow[name].lerp_(p.detach(), 1.0 - d)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite ``model``'s parameters with the averages."""
        for name, p in model.named_parameters():
            p.copy_(self.shadow[name])

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state is missing parameters {sorted(missing)[:5]}")
        unexpected = set(state["shadow"]) - set(self.shadow)
        if unexpected:
            raise ValueError(f"EMA state has unknown parameters {sorted(unexpected)[:5]}")
        self.decay, self.updates = state["decay"], state["updates"]
        # Accelerate (and torch.load with map_location="cpu") hands the state over on the CPU:
        # each average goes back to the device and dtype of the parameter it tracks
        self.shadow = {
            k: state["shadow"][k].to(device=own.device, dtype=own.dtype, copy=True)
            for k, own in self.shadow.items()
        }

"""One optimisation step the way training takes it, for the Trainer and the benchmark alike."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..parallel.trace import SavedTensorMeter
from .ema import EMA
from .sync import GradientSync


@dataclass
class OptimisationStep:
    """Loss under autocast, backward, the strategy's gradient synchronisation and clipping
    (:class:`GradientSync`), then the optimizer, schedule and EMA steps.

    ``model`` is the prepared one (DDP-wrapped, or the tensor-parallel model); the caller sets
    its train/eval mode. ``grad_clip`` 0: no clipping.
    """

    accelerator: Any
    model: nn.Module
    optimizer: Any
    sync: GradientSync
    grad_clip: float = 0.0
    scheduler: Any = None
    ema: EMA | None = None

    def __call__(
        self, loss_fn: Callable[[], torch.Tensor], meter: SavedTensorMeter | None = None
    ) -> torch.Tensor:
        """Take one step on ``loss_fn()``, this rank's loss under the gradient contract;
        ``meter`` (if given) measures the activation memory of computing it. Returns the loss."""
        with self.accelerator.autocast():
            with meter if meter is not None else contextlib.nullcontext():
                loss = loss_fn()
        self.accelerator.backward(loss)
        self.sync.sync_and_clip(self.model, self.grad_clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.accelerator.unwrap_model(self.model))
        return loss

"""Training :mod:`dspzoo.examples.axial3d` to predict the next frame of the moving-shapes clips.

The whole recipe a new model needs is a :class:`~dspzoo.core.train.Task` — data, model, loss,
evaluation — and the :class:`~dspzoo.core.train.Trainer` does the rest (flags, mesh, gradient
synchronisation, checkpoints, resume): every rank of an SP group gets the same clips
(:func:`~dspzoo.core.sp_dataloader`), the model shards them inside its forward and gathers the
prediction, each rank takes the (replicated) loss, and DDP averages gradients over dp × sp —
the gradient contract of ``docs/gradient_contract.md``.

The loss is the mean squared error of the predicted frames ``1 … T−1`` against the true ones;
the evaluation compares it with copying the last frame (what a model that learnt nothing of
motion would do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from dspzoo.core.train import RunConfig, Task, flag, load_initial_weights, train_task
from dspzoo.domains.video.data import MovingShapesConfig, MovingShapesDataset

from . import axial3d  # noqa: F401  (registers the axial3d family)


@dataclass
class Axial3DTrainConfig(RunConfig):
    """Every field is a command-line flag of ``scripts/train_axial3d.py``."""

    model: str = flag("axial3d-mini", "zoo model name (see `dspzoo list`)")
    frames: int = flag(8, "frames per clip")
    size: int = flag(32, "frame height and width in pixels (a multiple of the model's patch)")
    lr: float = flag(1e-3, "peak AdamW learning rate")
    eval_clips: int = flag(32, "held-out clips for the final evaluation")


class NextFrameShapes(Dataset):
    """Moving-shapes clips as ``{"video": [T, H, W, 3]}`` in ``[-1, 1]``; ``seed`` picks the
    split (training 0, held-out 1)."""

    def __init__(self, frames: int, size: int, num: int, seed: int) -> None:
        cfg = MovingShapesConfig(num_samples=num, frames=frames, height=size, width=size, seed=seed)
        self.clips = MovingShapesDataset(cfg)

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"video": self.clips[index]["video"].permute(1, 2, 3, 0)}


def next_frame_loss(pred: torch.Tensor, video: torch.Tensor) -> torch.Tensor:
    """MSE of the predictions for frames ``1 … T−1`` (made at frames ``0 … T−2``)."""
    return F.mse_loss(pred[:, :-1].float(), video[:, 1:].float())


@torch.no_grad()
def evaluate(model: torch.nn.Module, sp: Any, cfg: Axial3DTrainConfig) -> dict[str, float]:
    """Next-frame MSE on held-out clips, and the copy-the-last-frame baseline's."""
    data = NextFrameShapes(cfg.frames, cfg.size, cfg.eval_clips, seed=1)
    video = torch.stack([data[i]["video"] for i in range(len(data))])
    device = next(model.parameters()).device
    model.eval()
    mse = sum(
        next_frame_loss(model(chunk.to(device), sp=sp), chunk.to(device)).item() * len(chunk)
        for chunk in video.split(8)
    ) / len(video)
    model.train()
    return {"mse": mse, "copy_last_frame_mse": next_frame_loss(video, video).item()}


class Axial3DTask(Task):
    """Next-frame prediction of moving shapes: the example's part of a training run."""

    config_type = Axial3DTrainConfig
    name = "axial3d"
    loss_name = "mse"
    families = ("axial3d",)
    cfg: Axial3DTrainConfig

    def build_data(self) -> Dataset:
        return NextFrameShapes(self.cfg.frames, self.cfg.size, 4096, seed=0)

    def build_model(self) -> torch.nn.Module:
        from dspzoo.zoo import create_model

        with torch.random.fork_rng(devices=[]):  # weights from --seed alone, on every rank
            torch.manual_seed(self.cfg.seed)
            return load_initial_weights(create_model(self.cfg.model), self.cfg)

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        return self.cfg.frames * self.cfg.size**2  # pixels

    def loss(self, model: torch.nn.Module, batch: dict, step: int, sp: Any) -> torch.Tensor:
        video = batch["video"]
        return next_frame_loss(model(video, sp=sp), video)

    def evaluates_at(self, step: int) -> bool:
        return step == self.cfg.steps  # the held-out table of the final model only

    def evaluate(self, model: torch.nn.Module, sp: Any, step: int) -> dict[str, float]:
        return evaluate(model, sp, self.cfg)

    def log_evaluation(self, step: int, figures: dict[str, float]) -> None:
        self.logger.info("step %d held-out next-frame MSE %.4f (copy last frame: %.4f)",
                         step, figures["mse"], figures["copy_last_frame_mse"])  # fmt: skip

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        return {"eval": figures}

    def history_record(self, history: list[float], evals: list) -> dict[str, Any]:
        return {"mse": history, "eval": evals[-1][1] if evals else {}}

    def result_extra(self, figures: Any) -> dict[str, Any]:
        return {"eval": figures or {}}


def train(cfg: Axial3DTrainConfig) -> dict:
    """Run (or resume) training; returns ``{"losses", "eval", "output_dir", "is_main", ...}``."""
    return train_task(Axial3DTask(cfg))


@torch.no_grad()
def prediction_strip(model: torch.nn.Module, path: str, clips: int = 3, frames: int = 8,
                     size: int = 32) -> None:  # fmt: skip
    """Save a PNG: per held-out clip, a row of true frames over a row of the model's predictions
    for them (prediction ``t`` made from frames ``0 … t−1``)."""
    import numpy as np
    from PIL import Image

    data = NextFrameShapes(frames, size, clips, seed=1)
    video = torch.stack([data[i]["video"] for i in range(clips)])  # [N, T, H, W, 3]
    pred = model.eval()(video)
    rows = []
    for true, guess in zip(video, pred):
        rows += [torch.cat(list(true[1:]), dim=1), torch.cat(list(guess[:-1]), dim=1)]
    strip = torch.cat(rows, dim=0).clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    image = Image.fromarray(np.ascontiguousarray(strip.numpy()))
    image.resize((image.width * 3, image.height * 3), Image.NEAREST).save(path)

"""Training :mod:`dspzoo.examples.axial3d` to predict the next frame of the moving-shapes clips.

The whole recipe a new model needs, on the shared pieces (``core/runconfig.py`` flags,
``core/loop.py`` loop, ``core/tensor_parallel_training.py`` for ``megatron_sp``): every rank of
an SP group gets the same clips (:func:`~dspzoo.core.sp_dataloader`), the model shards them
inside its forward and gathers the prediction, each rank takes the (replicated) loss, and DDP
averages gradients over dp × sp — the gradient contract of ``docs/gradient_contract.md``.

The loss is the mean squared error of the predicted frames ``1 … T−1`` against the true ones;
the evaluation compares it with copying the last frame (what a model that learnt nothing of
motion would do).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from dspzoo.core.checkpoint import save_checkpoint
from dspzoo.core.configflags import flag
from dspzoo.core.loop import LoopSettings, run_training_loop
from dspzoo.core.loss import world_report
from dspzoo.core.resume import layout_of, resume_from
from dspzoo.core.runconfig import (
    RunConfig,
    load_initial_weights,
    start_run,
    train_loader,
    warmup_cosine,
)
from dspzoo.core.tensor_parallel_training import TensorParallelTraining
from dspzoo.domains.video.data import MovingShapesConfig, MovingShapesDataset

from . import axial3d  # noqa: F401  (registers the axial3d family)

logger = logging.getLogger("dspzoo.axial3d.train")


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


def train(cfg: Axial3DTrainConfig) -> dict:
    """Run (or resume) training; returns ``{"losses", "eval", "output_dir", "is_main"}``."""
    from dspzoo.zoo import create_model, save_pretrained

    accelerator, mesh, sp, output_dir = start_run(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = load_initial_weights(create_model(cfg.model), cfg)  # --init-from: a fine-tune
    tp = TensorParallelTraining(accelerator, mesh, sp)
    model = tp.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    model, optimizer = tp.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    data = NextFrameShapes(cfg.frames, cfg.size, 4096, seed=0)
    loader = train_loader(cfg, data, mesh)
    ckpt_dir, start, history = output_dir / "checkpoints", 0, []
    if cfg.resume:
        progress = resume_from(accelerator, mesh, cfg.resume, ckpt_dir, cfg.seed, {})
        start, history = int(progress["step"]), list(progress["loss_history"])

    def step_fn(batch: dict, step: int, meter: Any) -> float:
        video = batch["video"].to(accelerator.device)
        with accelerator.autocast():
            loss = next_frame_loss(model(video, sp=sp), video)
        accelerator.backward(loss)
        tp.sync_and_clip(model, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return world_report(loss)

    def save(step: int, losses: list[float]) -> None:
        progress = {"layout": layout_of(mesh), "loss_history": losses}
        save_checkpoint(accelerator, ckpt_dir, step, progress, keep=cfg.keep_checkpoints)

    settings = LoopSettings.of_run(cfg, start, cfg.global_batch * cfg.frames * cfg.size**2, "mse")
    session = run_training_loop(
        settings, loader, step_fn, save, model.parameters, history, mesh.is_main, logger,
        lambda: scheduler.get_last_lr()[0],
    )  # fmt: skip
    raw = accelerator.unwrap_model(model)
    figures = evaluate(raw, sp, cfg) if session.step >= cfg.steps else {}
    final = tp.full_model(raw) if figures else None  # collective
    if mesh.is_main:
        if final is not None:
            save_pretrained(
                final, output_dir / "final", config_name=cfg.model, extra={"eval": figures}
            )
            logger.info("held-out next-frame MSE %.4f (copy last frame: %.4f)",
                        figures["mse"], figures["copy_last_frame_mse"])  # fmt: skip
        losses = {"mse": history + session.losses, "eval": figures}
        (output_dir / "losses.json").write_text(json.dumps(losses))
    return {"losses": session.losses, "eval": figures, "output_dir": str(output_dir),
            "is_main": mesh.is_main}  # fmt: skip


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

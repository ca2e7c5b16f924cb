"""Rectified-flow training of a video DiT under DSP, for ``accelerate launch``.

One SP group holds one sample at a time: its latents are split over the group on the planned
dim, switched between spatial and temporal stages, and the loss is taken on the sharded
output tokens (no gather in training). Diffusion noise, timesteps and label dropout come from
the global RNG, seeded identically inside an SP group (:func:`dspzoo.core.seed_everything`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dspzoo.core import SavedTensorMeter, sp_dataloader, sp_mse, sp_report
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.ema import EMA
from dspzoo.core.trace import format_bytes

from .codec import PixelUnshuffleCodec
from .diffusion import TIMESTEP_SCALE, FlowConfig, noisy_pair, sample_t

logger = logging.getLogger("dspzoo.video.train")


@dataclass
class VideoTrainConfig:
    """Everything a training run needs; every field is a command-line flag."""

    model: str = "stdit-tiny"
    sp: int = 2
    steps: int = 300
    batch_size: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup: int = 20
    grad_clip: float = 1.0
    ema: float = 0.999  # decay of the parameter average saved as the final model (0: off)
    mixed_precision: str = "no"
    seed: int = 0
    data: str = "shapes"  # "shapes" (built-in) or a folder of videos
    num_samples: int = 2048
    frames: int = 8
    size: int = 32
    frame_stride: int = 1
    on_bad_video: str = "raise"
    codec_factor: int = 2
    class_dropout: float = 0.1
    timesteps: str = "logit-normal"  # training t distribution: "logit-normal" or "uniform"
    num_workers: int = 0
    output_dir: str = "outputs/stdit-tiny"
    save_every: int = 100
    log_every: int = 10
    resume: str | None = None  # a checkpoint folder, or "latest"
    stop_after: int | None = (
        None  # end this session after N steps (a checkpoint is saved), e.g. for time-limited jobs
    )
    extra: dict = field(default_factory=dict)


def build_dataset(cfg: VideoTrainConfig):
    """The training dataset: built-in moving shapes, or a folder of videos."""
    from .data import MovingShapesConfig, MovingShapesDataset, VideoFolderDataset

    if cfg.data == "shapes":
        return MovingShapesDataset(
            MovingShapesConfig(
                num_samples=cfg.num_samples,
                frames=cfg.frames,
                height=cfg.size,
                width=cfg.size,
                seed=cfg.seed,
            )
        )
    return VideoFolderDataset(
        cfg.data,
        frames=cfg.frames,
        height=cfg.size,
        width=cfg.size,
        frame_stride=cfg.frame_stride,
        on_error=cfg.on_bad_video,
    )


def build_model(
    cfg: VideoTrainConfig, num_classes: int, codec: PixelUnshuffleCodec
) -> torch.nn.Module:
    """Create the zoo model sized for the data (channels, frames, latent size, classes).

    The initial weights come from ``cfg.seed`` alone, identical on every rank, and the global
    RNG is left untouched: it stays seeded per DP group (by ``setup_accelerate``) for the
    diffusion noise, timesteps and label dropout.
    """
    from dspzoo.zoo import create_model

    latent = cfg.size // codec.factor
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return create_model(
            cfg.model,
            in_channels=codec.latent_channels,
            num_classes=num_classes,
            max_frames=max(cfg.frames, 16),
            input_size=(latent, latent),
            class_dropout_prob=cfg.class_dropout,
            cond_dim=0,  # the built-in data has class labels, no text tokens: no cross-attention
        )


def _lr_lambda(cfg: VideoTrainConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def _latest_checkpoint(output_dir: Path) -> Path | None:
    ckpts = sorted(output_dir.glob("checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1]))
    return ckpts[-1] if ckpts else None


def train(cfg: VideoTrainConfig) -> dict:
    """Run training; returns ``{"losses": [...], "tokens_per_s": ..., ...}`` on every rank."""
    if cfg.timesteps not in ("logit-normal", "uniform"):
        raise ValueError(f"--timesteps must be 'logit-normal' or 'uniform', got {cfg.timesteps!r}")
    accelerator, mesh, sp = setup_accelerate(
        cfg.sp, seed=cfg.seed, mixed_precision=cfg.mixed_precision
    )
    output_dir = Path(cfg.output_dir)
    if mesh.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    codec = PixelUnshuffleCodec(cfg.codec_factor)
    dataset = build_dataset(cfg)
    model = build_model(cfg, getattr(dataset, "num_classes", 1), codec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    # the scheduler is stepped by hand: Accelerate's wrapper would step it once per process
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    raw_model = accelerator.unwrap_model(model)
    ema = EMA(raw_model, cfg.ema) if cfg.ema else None
    if ema is not None:
        accelerator.register_for_checkpointing(ema)
    loader = sp_dataloader(
        dataset,
        mesh,
        cfg.batch_size,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        device=accelerator.device,
    )

    step = 0
    if cfg.resume:
        ckpt = _latest_checkpoint(output_dir) if cfg.resume == "latest" else Path(cfg.resume)
        if ckpt is None or not ckpt.exists():
            raise FileNotFoundError(
                f"--resume {cfg.resume}: no checkpoint found (looked in {output_dir / 'checkpoints'})"
            )
        accelerator.load_state(str(ckpt))
        step = json.loads((ckpt / "progress.json").read_text())["step"]
        if mesh.is_main:
            logger.info("resumed from %s at step %d", ckpt, step)

    start_step = step
    batches_per_epoch = len(loader)
    flow = FlowConfig(logit_normal=cfg.timesteps == "logit-normal")
    losses: list[float] = []
    tokens_per_sample = cfg.frames * (cfg.size // codec.factor // 2) ** 2
    timings: list[float] = []
    progress = tqdm(
        total=cfg.steps,
        initial=step,
        desc="train",
        disable=not mesh.is_main,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30,  # keep logs of non-interactive runs short
    )
    meter_bytes = 0
    while step < cfg.steps:
        epoch, skip = divmod(step, batches_per_epoch)
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            if step >= cfg.steps:
                break
            start = time.perf_counter()
            video, labels = batch["video"], batch["label"]
            x0 = codec.encode(video)
            t = sample_t(x0.shape[0], flow).to(x0.device)
            xt, velocity = noisy_pair(x0, t)
            model.train()
            with accelerator.autocast():
                measure = step == 0 or (cfg.resume and not meter_bytes)
                with (
                    SavedTensorMeter(model.parameters())
                    if measure
                    else contextlib.nullcontext() as meter
                ):
                    out = model(xt, t * TIMESTEP_SCALE, y=labels, sp=sp, gather_output=False)
                target = sp.shard_like(raw_model.patchify_target(velocity), out)
                pred = (
                    raw_model.split_sigma(out.tensor)[0]
                    if raw_model.config.learn_sigma
                    else out.tensor
                )
                loss = sp_mse(pred.float(), target.float(), sp.group)
            if measure:
                meter_bytes = meter.bytes
            accelerator.backward(loss)
            if cfg.grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(raw_model)
            step += 1
            full = sp_report(loss, sp.group)
            losses.append(full)
            timings.append(time.perf_counter() - start)
            progress.update(1)
            if mesh.is_main and (step % cfg.log_every == 0 or step == cfg.steps):
                recent = timings[-cfg.log_every :]
                tps = (
                    cfg.batch_size * mesh.dp_size * tokens_per_sample / (sum(recent) / len(recent))
                )
                progress.set_postfix(
                    loss=f"{sum(losses[-cfg.log_every :]) / len(losses[-cfg.log_every :]):.4f}",
                    tok_s=f"{tps:.0f}",
                )
                logger.info(
                    "step %d loss %.4f step_time %.3fs tokens/s %.0f lr %.2e",
                    step,
                    full,
                    sum(recent) / len(recent),
                    tps,
                    scheduler.get_last_lr()[0],
                )
            session_over = cfg.stop_after is not None and step - start_step >= cfg.stop_after
            if (cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps) or (
                session_over and step < cfg.steps
            ):
                _save_checkpoint(accelerator, output_dir, step, mesh.is_main)
            if session_over:
                break
        if cfg.stop_after is not None and step - start_step >= cfg.stop_after:
            break
    progress.close()
    accelerator.wait_for_everyone()
    if mesh.is_main and step >= cfg.steps:
        from dspzoo.zoo import save_pretrained

        if ema is not None:  # the final model carries the averaged weights
            ema.copy_to(raw_model)
        save_pretrained(raw_model, output_dir / "final")
    if mesh.is_main:
        (output_dir / "losses.json").write_text(json.dumps(losses))
        plot_losses(
            losses, output_dir / "losses.png", start_step, title=f"{cfg.model}, SP {cfg.sp}"
        )
    tps = (
        cfg.batch_size
        * mesh.dp_size
        * tokens_per_sample
        / (sum(timings[3:]) / max(1, len(timings[3:])))
        if len(timings) > 3
        else float("nan")
    )
    if mesh.is_main:
        logger.info(
            "done: %d steps, %.0f tokens/s, activation memory/rank %s",
            step,
            tps,
            format_bytes(meter_bytes),
        )
    return {
        "losses": losses,
        "tokens_per_s": tps,
        "activation_bytes": meter_bytes,
        "output_dir": str(output_dir),
        "is_main": mesh.is_main,
    }


def _save_checkpoint(accelerator, output_dir: Path, step: int, is_main: bool) -> None:
    """``accelerator.save_state`` into a temp folder, then an atomic rename."""
    final = output_dir / "checkpoints" / f"step_{step}"
    tmp = output_dir / "checkpoints" / f".tmp_step_{step}"
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if is_main:
        (tmp / "progress.json").write_text(json.dumps({"step": step}))
        if final.exists():
            import shutil

            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def plot_losses(
    losses: list[float],
    path: Path,
    start_step: int = 0,
    window: int = 50,
    title: str = "training loss",
) -> None:
    """Loss per step and its moving average, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(start_step + 1, start_step + len(losses) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, losses, lw=0.6, alpha=0.35, label="loss")
    if len(losses) >= window:
        smooth = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(steps[window - 1 :], smooth, lw=1.6, label=f"mean of {window}")
    ax.set(xlabel="step", ylabel="rectified-flow MSE", yscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

"""Rectified-flow training of a video DiT under DSP, for ``accelerate launch``.

One SP group holds one share of the global batch: its latents are split over the group on the
planned dim, switched between spatial and temporal stages, and the loss is taken on the
sharded output tokens (no gather in training).

Every random draw — the sample order, diffusion noise, timesteps and label dropout — is a
function of ``(seed, step, global sample index)`` (:mod:`dspzoo.core.rng`,
:class:`dspzoo.core.data.SPBatchSampler`). So the ranks of an SP group draw identically by
construction, the loss sequence is the same for every dp × sp layout with the same global
batch, and a run resumed at any layout continues exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspzoo.core import SavedTensorMeter, sp_mse
from dspzoo.core.checkpoint import save_checkpoint
from dspzoo.core.configflags import check_values, flag
from dspzoo.core.ema import EMA
from dspzoo.core.loop import LoopSettings, run_training_loop
from dspzoo.core.loss import world_report
from dspzoo.core.resume import layout_of, mean_step_time, resume_from
from dspzoo.core.rng import SampleRandom
from dspzoo.core.runconfig import (
    RunConfig,
    load_initial_weights,
    start_run,
    train_loader,
    warmup_cosine,
)
from dspzoo.core.tensor_parallel_training import TensorParallelTraining
from dspzoo.core.trace import format_bytes

from .codec import PixelUnshuffleCodec
from .diffusion import TIMESTEP_SCALE, FlowConfig, keyed_t, noisy_pair

logger = logging.getLogger("dspzoo.video.train")


@dataclass
class VideoTrainConfig(RunConfig):
    """Everything a training run needs; every field is a command-line flag."""

    model: str = flag("stdit-tiny", "zoo model name (see `dspzoo list`)")
    ema: float = flag(0.999, "decay of the parameter average saved as the final model (0: no EMA)")
    seed: int = flag(0, "seed of the weights, data order, noise, timesteps and label dropout")
    data: str = flag(
        "shapes", "'shapes' (built-in moving shapes) or a folder of videos (class = sub-folder)"
    )
    num_samples: int = flag(2048, "number of built-in moving-shapes clips")
    frames: int = flag(8, "frames per clip")
    size: int = flag(32, "frame height and width in pixels")
    frame_stride: int = flag(1, "take every n-th frame of a video file")
    on_bad_video: str = flag(
        "raise",
        "undecodable video files: raise naming the file, or skip with a warning",
        ("raise", "skip"),
    )
    codec_factor: int = flag(2, "space-to-depth factor from pixels to latents")
    class_dropout: float = flag(
        0.1, "probability of replacing a label by the null label (classifier-free guidance)"
    )
    timesteps: str = flag(
        "logit-normal", "distribution of training timesteps t", ("logit-normal", "uniform")
    )

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        super().validate()
        check_values(self, positive=("frames", "size", "frame_stride"))
        if not 0.0 <= self.class_dropout <= 1.0:
            raise ValueError(f"--class-dropout must be in [0, 1], got {self.class_dropout}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"--ema must be in [0, 1), got {self.ema}")


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
    RNG is left untouched.
    """
    from dspzoo.zoo import create_model

    latent = cfg.size // codec.factor
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = create_model(
            cfg.model,
            in_channels=codec.latent_channels,
            num_classes=num_classes,
            max_frames=max(cfg.frames, 16),
            input_size=(latent, latent),
            class_dropout_prob=cfg.class_dropout,
            cond_dim=0,  # the built-in data has class labels, no text tokens: no cross-attention
        )
    return load_initial_weights(model, cfg)


def sampling_settings(cfg: VideoTrainConfig) -> dict[str, Any]:
    """What a sampler needs besides the weights; saved inside the final model folder."""
    return {
        "frames": cfg.frames,
        "size": cfg.size,
        "codec": "pixel-unshuffle",
        "codec_factor": cfg.codec_factor,
        "data": cfg.data,
    }


@dataclass
class TrainingRun:
    """The live objects of one training session."""

    cfg: VideoTrainConfig
    accelerator: Any
    mesh: Any
    sp: Any
    model: torch.nn.Module
    raw_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: EMA | None
    tp: TensorParallelTraining
    loader: Any
    codec: PixelUnshuffleCodec
    flow: FlowConfig
    output_dir: Path

    @property
    def batch_per_dp(self) -> int:
        return self.cfg.global_batch // self.mesh.dp_size

    def tokens_per_sample(self) -> int:
        """Tokens the model sees per clip: ``(T/pt) · (H/ph) · (W/pw)`` of the latent grid."""
        pt, ph, pw = self.raw_model.config.patch
        latent = self.cfg.size // self.codec.factor
        return (self.cfg.frames // pt) * (latent // ph) * (latent // pw)


def setup_run(cfg: VideoTrainConfig) -> TrainingRun:
    """Accelerator, mesh, data, model, optimizer, schedule and EMA for ``cfg``."""
    accelerator, mesh, sp, output_dir = start_run(cfg)
    codec = PixelUnshuffleCodec(cfg.codec_factor)
    dataset = build_dataset(cfg)
    tp = TensorParallelTraining(accelerator, mesh, sp)  # weight sharding (megatron_sp) or not
    model = tp.shard(build_model(cfg, getattr(dataset, "num_classes", 1), codec))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    # the scheduler is stepped by hand: Accelerate's wrapper would step it once per process
    model, optimizer = tp.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    raw_model = accelerator.unwrap_model(model)
    ema = EMA(raw_model, cfg.ema) if cfg.ema else None  # of this rank's shards when sharded
    if ema is not None:
        accelerator.register_for_checkpointing(tp.checkpointable(ema))
    loader = train_loader(cfg, dataset, mesh, device=accelerator.device)
    return TrainingRun(
        cfg=cfg,
        accelerator=accelerator,
        mesh=mesh,
        sp=sp,
        model=model,
        raw_model=raw_model,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=ema,
        tp=tp,
        loader=loader,
        codec=codec,
        flow=FlowConfig(logit_normal=cfg.timesteps == "logit-normal"),
        output_dir=output_dir,
    )


def restore(run: TrainingRun) -> tuple[int, list[float]]:
    """Load ``--resume``'s checkpoint; returns ``(step, loss history up to step)``.

    The checkpoint may come from any dp × sp layout and strategy: the model, optimizer,
    schedule and EMA are saved as full tensors (sliced on load when the strategy shards
    weights), and every random draw is keyed by (seed, step, sample). Accelerate
    also restores per-process RNG states (missing ones when the world grew); the global RNGs
    are re-seeded afterwards so they are identical inside every SP group again.
    """
    cfg = run.cfg
    progress = resume_from(
        run.accelerator,
        run.mesh,
        cfg.resume,
        run.output_dir / "checkpoints",
        cfg.seed,
        {"global_batch": cfg.global_batch, "seed": cfg.seed},
    )
    step = int(progress["step"])
    return step, list(progress.get("loss_history", []))[:step]


def step_randomness(run: TrainingRun, step: int) -> SampleRandom:
    """The keyed draws of ``step`` for this DP group's share of the global batch."""
    b = run.batch_per_dp
    first = step * run.cfg.global_batch + run.mesh.dp_rank * b
    return SampleRandom.for_batch(run.cfg.seed, step, range(first, first + b))


def training_step(
    run: TrainingRun, batch: dict[str, torch.Tensor], step: int, meter: SavedTensorMeter | None
) -> float:
    """One optimisation step on this rank's share; returns the global-batch loss."""
    video, labels = batch["video"], batch["label"]
    x0 = run.codec.encode(video)
    draws = step_randomness(run, step)
    t = keyed_t(draws, run.flow).to(x0.device)
    noise = draws.randn("noise", x0.shape[1:], dtype=x0.dtype)
    label_drop = draws.bernoulli("label-drop", run.cfg.class_dropout, device=x0.device)
    xt, velocity = noisy_pair(x0, t, noise=noise)
    run.model.train()
    with run.accelerator.autocast():
        with meter if meter is not None else contextlib.nullcontext():
            out = run.model(
                xt,
                t * TIMESTEP_SCALE,
                y=labels,
                sp=run.sp,
                gather_output=False,
                label_drop=label_drop,
            )
        target = run.sp.shard_like(run.raw_model.patchify_target(velocity), out)
        pred = (
            run.raw_model.split_sigma(out.tensor)[0]
            if run.raw_model.config.learn_sigma
            else out.tensor
        )
        loss = sp_mse(pred.float(), target.float(), run.sp.group)
    run.accelerator.backward(loss)
    run.tp.sync_and_clip(run.model, run.cfg.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.raw_model)
    return world_report(loss)


def checkpoint(run: TrainingRun, step: int, history: list[float]) -> None:
    """Save a resumable checkpoint at ``step`` with the layout and the loss history."""
    progress = {
        "seed": run.cfg.seed,
        "global_batch": run.cfg.global_batch,
        "model": run.cfg.model,
        "layout": layout_of(run.mesh),
        "loss_history": history,
    }
    save_checkpoint(
        run.accelerator,
        run.output_dir / "checkpoints",
        step,
        progress,
        keep=run.cfg.keep_checkpoints,
    )


def finish(run: TrainingRun, step: int, history: list[float], start_step: int) -> None:
    """Save the final model (EMA weights) when the run is complete; write the loss history."""
    run.accelerator.wait_for_everyone()
    complete = step >= run.cfg.steps
    if complete:
        if run.ema is not None:  # the final model carries the averaged weights
            run.ema.copy_to(run.raw_model)
        final = run.tp.full_model(run.raw_model)  # every rank: shards are gathered
    if not run.mesh.is_main:
        return
    if complete:
        from dspzoo.zoo import save_pretrained

        save_pretrained(
            final,
            run.output_dir / "final",
            config_name=run.cfg.model,
            extra={"sampling": sampling_settings(run.cfg)},
        )
    (run.output_dir / "losses.json").write_text(json.dumps(history))
    plot_losses(
        history,
        run.output_dir / "losses.png",
        title=f"{run.cfg.model}, global batch {run.cfg.global_batch}",
        resumed_at=start_step or None,
    )


def train(cfg: VideoTrainConfig) -> dict:
    """Run (or resume) training. Returns on every rank::

    {"losses": this session's losses, "loss_history": all losses from step 1,
     "tokens_per_s": ..., "activation_bytes": ..., "output_dir": ..., "is_main": ...}
    """
    run = setup_run(cfg)
    start_step, history = restore(run) if cfg.resume else (0, [])
    settings = LoopSettings.of_run(cfg, start_step, cfg.global_batch * run.tokens_per_sample())
    session = run_training_loop(
        settings,
        run.loader,
        lambda batch, step, meter: training_step(run, batch, step, meter),
        lambda step, losses: checkpoint(run, step, losses),
        run.model.parameters,
        history,
        run.mesh.is_main,
        logger,
        lambda: run.scheduler.get_last_lr()[0],
    )
    losses, step, meter_bytes = session.losses, session.step, session.activation_bytes
    history = history + losses
    finish(run, step, history, start_step)
    tps = settings.tokens_per_step / mean_step_time(session.timings)
    if run.mesh.is_main:
        logger.info(
            "done: %d steps, %.0f tokens/s, activation memory/rank %s",
            step,
            tps,
            format_bytes(meter_bytes),
        )
    return {
        "losses": losses,
        "loss_history": history,
        "tokens_per_s": tps,
        "activation_bytes": meter_bytes,
        "output_dir": str(run.output_dir),
        "is_main": run.mesh.is_main,
    }


def plot_losses(
    losses: list[float],
    path: Path,
    window: int = 50,
    title: str = "training loss",
    resumed_at: int | None = None,
) -> None:
    """Loss per step (from step 1) and its moving average, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
    ax.plot(steps, losses, lw=0.6, alpha=0.35, label="loss")
    if len(losses) >= window:
        smooth = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(steps[window - 1 :], smooth, lw=1.6, label=f"mean of {window}")
    if resumed_at:
        ax.axvline(resumed_at + 0.5, color="grey", lw=0.8, ls="--", label="resumed")
    ax.set(xlabel="step", ylabel="rectified-flow MSE", yscale="log", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

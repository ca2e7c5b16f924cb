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
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dspzoo.core import SavedTensorMeter, seed_everything, sp_dataloader, sp_mse
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.checkpoint import latest_checkpoint, read_progress, save_checkpoint
from dspzoo.core.ema import EMA
from dspzoo.core.loss import world_report
from dspzoo.core.rng import SampleRandom, mix_key
from dspzoo.core.strategies import STRATEGIES
from dspzoo.core.trace import format_bytes

from .codec import PixelUnshuffleCodec
from .diffusion import TIMESTEP_SCALE, FlowConfig, keyed_t, noisy_pair

logger = logging.getLogger("dspzoo.video.train")


def _flag(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A config field that is also a command-line flag with a description and choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class VideoTrainConfig:
    """Everything a training run needs; every field is a command-line flag."""

    model: str = _flag("stdit-tiny", "zoo model name (see `dspzoo list`)")
    sp: int = _flag(2, "ranks per sequence-parallel group; must divide the number of processes")
    sp_strategy: str = _flag(
        "dsp",
        "how the SP group runs the model: dsp switches the sharded dim between stages; the "
        "embedded methods shard one dim and communicate inside attention",
        tuple(STRATEGIES),
    )
    steps: int = _flag(
        300,
        "total optimisation steps, counted from the start of training (a resumed run goes on to it)",
    )
    global_batch: int = _flag(
        4,
        "samples per step over all data-parallel groups; each DP group takes global_batch / dp. "
        "Keep it fixed to get the same run at any dp × sp layout",
    )
    lr: float = _flag(3e-4, "peak AdamW learning rate")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    warmup: int = _flag(20, "linear warm-up steps, then cosine decay to 10%% of the peak")
    grad_clip: float = _flag(1.0, "clip the global gradient norm to this value (0: off)")
    ema: float = _flag(0.999, "decay of the parameter average saved as the final model (0: no EMA)")
    mixed_precision: str = _flag("no", "autocast precision (GPU)", ("no", "fp16", "bf16"))
    seed: int = _flag(0, "seed of the weights, data order, noise, timesteps and label dropout")
    data: str = _flag(
        "shapes", "'shapes' (built-in moving shapes) or a folder of videos (class = sub-folder)"
    )
    num_samples: int = _flag(2048, "number of built-in moving-shapes clips")
    frames: int = _flag(8, "frames per clip")
    size: int = _flag(32, "frame height and width in pixels")
    frame_stride: int = _flag(1, "take every n-th frame of a video file")
    on_bad_video: str = _flag(
        "raise",
        "undecodable video files: raise naming the file, or skip with a warning",
        ("raise", "skip"),
    )
    codec_factor: int = _flag(2, "space-to-depth factor from pixels to latents")
    class_dropout: float = _flag(
        0.1, "probability of replacing a label by the null label (classifier-free guidance)"
    )
    timesteps: str = _flag(
        "logit-normal", "distribution of training timesteps t", ("logit-normal", "uniform")
    )
    num_workers: int = _flag(0, "dataloader worker processes per rank")
    output_dir: str | None = _flag(None, "where checkpoints, logs and the final model go")
    save_every: int = _flag(100, "save a checkpoint every n steps (0: only at --stop-after)")
    keep_checkpoints: int = _flag(3, "keep the newest n checkpoints (0: keep all)")
    log_every: int = _flag(10, "log (and average the reported loss over) every n steps")
    resume: str | None = _flag(None, "a checkpoint folder, or 'latest' in <output-dir>/checkpoints")
    stop_after: int | None = _flag(
        None, "end this session after n steps with a checkpoint (for time-limited jobs)"
    )

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = f"outputs/{self.model}"

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        for f in self.__dataclass_fields__.values():
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {list(choices)}, "
                    f"got {getattr(self, f.name)!r}"
                )
        positive = ("sp", "steps", "global_batch", "frames", "size", "frame_stride", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("save_every", "keep_checkpoints", "num_workers", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if not 0.0 <= self.class_dropout <= 1.0:
            raise ValueError(f"--class-dropout must be in [0, 1], got {self.class_dropout}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"--ema must be in [0, 1), got {self.ema}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")


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
        return create_model(
            cfg.model,
            in_channels=codec.latent_channels,
            num_classes=num_classes,
            max_frames=max(cfg.frames, 16),
            input_size=(latent, latent),
            class_dropout_prob=cfg.class_dropout,
            cond_dim=0,  # the built-in data has class labels, no text tokens: no cross-attention
        )


def sampling_settings(cfg: VideoTrainConfig) -> dict[str, Any]:
    """What a sampler needs besides the weights; saved inside the final model folder."""
    return {
        "frames": cfg.frames,
        "size": cfg.size,
        "codec": "pixel-unshuffle",
        "codec_factor": cfg.codec_factor,
        "data": cfg.data,
    }


def _lr_lambda(cfg: VideoTrainConfig):
    def fn(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


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
    cfg.validate()
    accelerator, mesh, sp = setup_accelerate(
        cfg.sp, seed=cfg.seed, strategy=cfg.sp_strategy, mixed_precision=cfg.mixed_precision
    )
    if cfg.global_batch % mesh.dp_size:
        raise ValueError(
            f"--global-batch {cfg.global_batch} is not divisible by the {mesh.dp_size} "
            f"data-parallel groups ({mesh.world_size} processes / SP {cfg.sp}); choose a "
            f"multiple of {mesh.dp_size}"
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
        cfg.global_batch // mesh.dp_size,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        device=accelerator.device,
    )
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
        loader=loader,
        codec=codec,
        flow=FlowConfig(logit_normal=cfg.timesteps == "logit-normal"),
        output_dir=output_dir,
    )


def _layout(run: TrainingRun) -> dict[str, int]:
    return {"world": run.mesh.world_size, "dp": run.mesh.dp_size, "sp": run.mesh.sp_size}


def restore(run: TrainingRun) -> tuple[int, list[float]]:
    """Load ``--resume``'s checkpoint; returns ``(step, loss history up to step)``.

    The checkpoint may come from any dp × sp layout: the model, optimizer, schedule and EMA
    are replicated state, and every random draw is keyed by (seed, step, sample). Accelerate
    also restores per-process RNG states (missing ones when the world grew); the global RNGs
    are re-seeded afterwards so they are identical inside every SP group again.
    """
    cfg = run.cfg
    ckpt_dir = run.output_dir / "checkpoints"
    ckpt = latest_checkpoint(ckpt_dir) if cfg.resume == "latest" else Path(cfg.resume)
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(
            f"--resume {cfg.resume}: no checkpoint found (looked in {ckpt_dir})"
        )
    progress = read_progress(ckpt)
    run.accelerator.load_state(str(ckpt))
    step = int(progress["step"])
    seed_everything(run.mesh, mix_key(cfg.seed, step, "global-rng"))
    if run.mesh.is_main:
        saved, now = progress.get("layout"), _layout(run)
        logger.info("resumed from %s at step %d", ckpt, step)
        if saved is not None and saved != now:
            logger.warning(
                "resuming a checkpoint saved at dp %d × sp %d (%d processes) at dp %d × sp %d "
                "(%d processes): data order and training randomness are keyed by (seed, step, "
                "sample), so the run continues as it would have at the old layout",
                saved["dp"], saved["sp"], saved["world"], now["dp"], now["sp"], now["world"],
            )  # fmt: skip
        if progress.get("global_batch", cfg.global_batch) != cfg.global_batch:
            logger.warning(
                "the checkpoint was trained with --global-batch %s, this run uses %d: the loss "
                "sequence will differ from an uninterrupted run",
                progress.get("global_batch"),
                cfg.global_batch,
            )
        if progress.get("seed", cfg.seed) != cfg.seed:
            logger.warning("the checkpoint was trained with --seed %s, this run uses %d",
                           progress.get("seed"), cfg.seed)  # fmt: skip
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
    if run.cfg.grad_clip:
        run.accelerator.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.raw_model)
    return world_report(loss)


def mean_step_time(timings: list[float], last: int | None = None) -> float:
    """Mean of the ``last`` step times, leaving out the session's first (warm-up) step when
    there are others."""
    rest = timings[1:] if len(timings) > 1 else timings
    rest = rest[-last:] if last else rest
    return sum(rest) / len(rest) if rest else float("nan")


def checkpoint(run: TrainingRun, step: int, history: list[float]) -> None:
    """Save a resumable checkpoint at ``step`` with the layout and the loss history."""
    progress = {
        "seed": run.cfg.seed,
        "global_batch": run.cfg.global_batch,
        "model": run.cfg.model,
        "layout": _layout(run),
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
    if not run.mesh.is_main:
        return
    if step >= run.cfg.steps:
        from dspzoo.zoo import save_pretrained

        if run.ema is not None:  # the final model carries the averaged weights
            run.ema.copy_to(run.raw_model)
        save_pretrained(
            run.raw_model, run.output_dir / "final", extra={"sampling": sampling_settings(run.cfg)}
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
    step, history = restore(run) if cfg.resume else (0, [])
    start_step = step
    losses: list[float] = []
    timings: list[float] = []
    window = cfg.log_every
    progress = tqdm(
        total=cfg.steps,
        initial=step,
        desc="train",
        disable=not run.mesh.is_main,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30,  # keep logs of non-interactive runs short
    )
    meter_bytes = 0
    session_over = False
    while step < cfg.steps and not session_over:
        run.loader.set_step(step)
        for batch in run.loader:
            start = time.perf_counter()
            meter = SavedTensorMeter(run.model.parameters()) if step == start_step else None
            loss = training_step(run, batch, step, meter)
            if meter is not None:
                meter_bytes = meter.bytes
            step += 1
            losses.append(loss)
            timings.append(time.perf_counter() - start)
            progress.update(1)
            if step % window == 0 or step == cfg.steps:
                recent = losses[-window:]
                avg = sum(recent) / len(recent)
                tps = cfg.global_batch * run.tokens_per_sample() / mean_step_time(timings, window)
                progress.set_postfix({f"loss(avg{window})": f"{avg:.4f}", "tok/s": f"{tps:.0f}"})
                if run.mesh.is_main:
                    logger.info(
                        "step %d loss(avg%d) %.4f step_time %.3fs tokens/s %.0f lr %.2e",
                        step,
                        window,
                        avg,
                        mean_step_time(timings, window),
                        tps,
                        run.scheduler.get_last_lr()[0],
                    )
            session_over = cfg.stop_after is not None and step - start_step >= cfg.stop_after
            periodic = cfg.save_every and step % cfg.save_every == 0
            if step < cfg.steps and (periodic or session_over):
                checkpoint(run, step, history + losses)
            if session_over or step >= cfg.steps:
                break
    progress.close()
    history = history + losses
    finish(run, step, history, start_step)
    tps = cfg.global_batch * run.tokens_per_sample() / mean_step_time(timings)
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

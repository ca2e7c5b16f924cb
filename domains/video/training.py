"""Rectified-flow training of a video DiT under DSP, for ``accelerate launch``.

One SP group holds one share of the global batch: its latents are split over the group on the
planned dim, switched between spatial and temporal stages, and the loss is taken on the
sharded output tokens (no gather in training).

Every random draw — the sample order, diffusion noise, timesteps and label dropout — is a
function of ``(seed, step, global sample index)`` (:mod:`dspzoo.core.parallel.rng`,
:class:`dspzoo.core.data.SPBatchSampler`). So the ranks of an SP group draw identically by
construction, the loss sequence is the same for every dp × sp layout with the same global
batch, and a run resumed at any layout continues exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspzoo.core import sp_mse
from dspzoo.core.parallel.rng import SampleRandom
from dspzoo.core.train import RunConfig, Task, check_values, flag, load_initial_weights, train_task

from ...core.errors import UsageError
from .codec import PixelUnshuffleCodec
from .diffusion import TIMESTEP_SCALE, FlowConfig, keyed_t, noisy_pair


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
            raise UsageError(f"--class-dropout must be in [0, 1], got {self.class_dropout}")
        if not 0.0 <= self.ema < 1.0:
            raise UsageError(f"--ema must be in [0, 1), got {self.ema}")


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


class VideoTask(Task):
    """Rectified flow on latents: the video domain's part of a training run."""

    config_type = VideoTrainConfig
    name = "video"
    families = ("stdit", "latte", "videomamba")  # latte1 (the converted Latte-1) samples only
    cfg: VideoTrainConfig

    def build_data(self):
        self.codec = PixelUnshuffleCodec(self.cfg.codec_factor)
        self.flow = FlowConfig(logit_normal=self.cfg.timesteps == "logit-normal")
        self.dataset = build_dataset(self.cfg)
        return self.dataset

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg, getattr(self.dataset, "num_classes", 1), self.codec)

    def ema_decay(self) -> float:
        return self.cfg.ema

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        """Tokens the model sees per clip: ``(T/pt) · (H/ph) · (W/pw)`` of the latent grid."""
        pt, ph, pw = model.config.patch
        latent = self.cfg.size // self.codec.factor
        return (self.cfg.frames // pt) * (latent // ph) * (latent // pw)

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int, sp: Any
    ) -> torch.Tensor:
        """This rank's share of the rectified-flow MSE on its sharded output tokens; noise,
        timesteps and label dropout keyed by ``(seed, step, global sample index)``."""
        video, labels = batch["video"], batch["label"]
        x0 = self.codec.encode(video)
        draws = SampleRandom.for_batch(self.cfg.seed, step, self.samples(step))
        t = keyed_t(draws, self.flow).to(x0.device)
        noise = draws.randn("noise", x0.shape[1:], dtype=x0.dtype)
        label_drop = draws.bernoulli("label-drop", self.cfg.class_dropout, device=x0.device)
        xt, velocity = noisy_pair(x0, t, noise=noise)
        out = model(
            xt, t * TIMESTEP_SCALE, y=labels, sp=sp, gather_output=False, label_drop=label_drop
        )
        raw = self.accelerator.unwrap_model(model)
        target = sp.shard_like(raw.patchify_target(velocity), out)
        pred = raw.split_sigma(out.tensor)[0] if raw.config.learn_sigma else out.tensor
        return sp_mse(pred.float(), target.float(), sp.group)

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        return {"sampling": sampling_settings(self.cfg)}

    def history_record(self, history: list[float], evals: list) -> list[float]:
        return history

    def after_finish(
        self, history: list[float], evals: list, figures: Any, start_step: int
    ) -> None:
        plot_losses(
            history,
            self.output_dir / "losses.png",
            title=f"{self.cfg.model}, global batch {self.cfg.global_batch}",
            resumed_at=start_step or None,
        )


def train(cfg: VideoTrainConfig) -> dict:
    """Run (or resume) training (:class:`~dspzoo.core.train.Trainer`). Returns on every rank::

    {"losses": this session's losses, "loss_history": all losses from step 1,
     "tokens_per_s": ..., "activation_bytes": ..., "output_dir": ..., "is_main": ...}
    """
    return train_task(VideoTask(cfg))


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

"""Byte-level language-model training under sequence parallelism, for ``accelerate launch``.

Each SP group holds one share of the global batch of ``seq_len``-byte windows. ``sp.enter``
splits every window's bytes over the group; the strategy (``--sp-strategy``: ``lss``,
``ring``, ``ulysses``, ...) decides what causal attention over the sharded sequence
communicates; each rank takes the cross-entropy of its own bytes (:func:`lm_loss`, the
gradient contract), and DDP averages gradients over dp × sp (under ``megatron_sp``, which
shards the weights: :class:`~dspzoo.core.tensor_parallel_training.TensorParallelTraining`).

The only randomness of a run is the data order, a function of ``(seed, epoch)``
(:class:`dspzoo.core.data.SPBatchSampler`), and the initial weights, a function of ``seed``:
so the loss sequence is the same at every dp × sp layout with the same ``--global-batch``, and
a run resumed from a checkpoint (at any layout) continues exactly. Losses are reported in bits
per byte (cross-entropy / ln 2); ``--eval-every`` measures bits per byte on held-out windows
(the last 5 % of the data).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dspzoo.core import SavedTensorMeter
from dspzoo.core.checkpoint import save_checkpoint
from dspzoo.core.configflags import check_values, flag
from dspzoo.core.loop import LoopSettings, run_training_loop
from dspzoo.core.loss import world_report
from dspzoo.core.resume import layout_of, mean_step_time, resume_from
from dspzoo.core.runconfig import (
    RunConfig,
    load_initial_weights,
    start_run,
    train_loader,
    warmup_cosine,
)
from dspzoo.core.strategies import STRATEGIES
from dspzoo.core.tensor_parallel_training import TensorParallelTraining
from dspzoo.core.trace import format_bytes

from .data import ByteWindows, resolve_data
from .model import lm_loss

logger = logging.getLogger("dspzoo.text.train")
LN2 = math.log(2.0)


@dataclass
class TextTrainConfig(RunConfig):
    """Everything a training run needs; every field is a command-line flag."""

    model: str = flag("bytelm-small", "zoo model name (see `dspzoo list`)")
    sp_strategy: str = flag(
        "lss",
        "sequence-parallel strategy, i.e. how causal attention over the sharded sequence "
        "communicates (dsp plans a hybrid with an embedded method for this 1-D model)",
        tuple(STRATEGIES),
    )
    seq_len: int = flag(512, "bytes per training window (the model's sequence length)")
    steps: int = flag(
        1000,
        "total optimisation steps, counted from the start of training (a resumed run goes on to it)",
    )
    global_batch: int = flag(
        8,
        "windows per step over all data-parallel groups; each DP group takes global_batch / dp. "
        "Keep it fixed to get the same run at any dp × sp layout",
    )
    lr: float = flag(1e-3, "peak AdamW learning rate")
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices only, not norms or biases)")
    warmup: int = flag(50, "linear warm-up steps, then cosine decay to 10%% of the peak")
    activation_checkpointing: bool = flag(
        False, "recompute every block in the backward pass instead of keeping its activations"
    )
    seed: int = flag(0, "seed of the initial weights and the data order")
    data: str = flag(
        "stdlib",
        "'stdlib' (the Python standard library's sources, built and cached at first use) or "
        "the path of a raw byte file such as enwik8",
    )
    val_fraction: float = flag(0.05, "share of the data, at its end, held out for validation")
    eval_every: int = flag(100, "measure validation bits per byte every n steps (0: off)")
    eval_windows: int = flag(32, "held-out windows per validation (the first ones)")
    save_every: int = flag(200, "save a checkpoint every n steps (0: only at --stop-after)")

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        super().validate()
        check_values(self, positive=("seq_len", "eval_windows"), non_negative=("eval_every",))

        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class TrainingRun:
    """The live objects of one training session."""

    cfg: TextTrainConfig
    accelerator: Any
    mesh: Any
    sp: Any
    model: torch.nn.Module
    raw_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tp: TensorParallelTraining
    loader: Any
    val_data: ByteWindows
    output_dir: Path

    @property
    def batch_per_dp(self) -> int:
        return self.cfg.global_batch // self.mesh.dp_size

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch * self.cfg.seq_len


def build_model(cfg: TextTrainConfig) -> torch.nn.Module:
    """The zoo model; its initial weights depend on ``cfg.seed`` only (global RNG untouched)."""
    from dspzoo.zoo import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = create_model(cfg.model, checkpoint=cfg.activation_checkpointing)
    mc = model.config
    if mc.position == "learned" and cfg.seq_len > mc.max_len:
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s learned position table "
            f"(max_len={mc.max_len}); pick a rotary model or a shorter --seq-len"
        )
    return load_initial_weights(model, cfg)


def build_optimizer(model: torch.nn.Module, cfg: TextTrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (linear and embedding weights) only."""
    params = {id(p): p for p in model.parameters()}.values()  # a tied weight counts once
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other}]
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))


def setup_run(cfg: TextTrainConfig) -> TrainingRun:
    """Accelerator, mesh, SP context, data, model, optimizer and schedule for ``cfg``."""
    accelerator, mesh, sp, output_dir = start_run(cfg)
    path = resolve_data(cfg.data)
    train_data = ByteWindows(path, cfg.seq_len, "train", cfg.val_fraction)
    val_data = ByteWindows(path, cfg.seq_len, "val", cfg.val_fraction)
    tp = TensorParallelTraining(accelerator, mesh, sp)  # weight sharding (megatron_sp) or not
    model = tp.shard(build_model(cfg))
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    # the scheduler is stepped by hand: Accelerate's wrapper would step it once per process
    model, optimizer = tp.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    loader = train_loader(cfg, train_data, mesh, device=accelerator.device)
    return TrainingRun(
        cfg=cfg,
        accelerator=accelerator,
        mesh=mesh,
        sp=sp,
        model=model,
        raw_model=accelerator.unwrap_model(model),
        optimizer=optimizer,
        scheduler=scheduler,
        tp=tp,
        loader=loader,
        val_data=val_data,
        output_dir=output_dir,
    )


def restore(run: TrainingRun) -> tuple[int, list[float], list[list[float]]]:
    """Load ``--resume``'s checkpoint (from any layout); returns ``(step, loss history,
    validation history)`` up to that step."""
    cfg = run.cfg
    progress = resume_from(
        run.accelerator,
        run.mesh,
        cfg.resume,
        run.output_dir / "checkpoints",
        cfg.seed,
        {key: getattr(cfg, key) for key in ("global_batch", "seq_len", "seed")},
    )
    step = int(progress["step"])
    evals = [e for e in progress.get("evals", []) if e[0] <= step]
    return step, list(progress.get("loss_history", []))[:step], evals


def training_step(
    run: TrainingRun, batch: dict[str, torch.Tensor], meter: SavedTensorMeter | None
) -> float:
    """One optimisation step on this rank's share; returns the global batch's bits per byte."""
    run.model.train()
    with run.accelerator.autocast():
        with meter if meter is not None else contextlib.nullcontext():
            logits = run.model(batch["tokens"], sp=run.sp, gather_output=False)
        loss = lm_loss(logits, batch["targets"], run.sp)
    run.accelerator.backward(loss)
    run.tp.sync_and_clip(run.model, run.cfg.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return world_report(loss) / LN2


@torch.no_grad()
def evaluate(run: TrainingRun) -> float:
    """Bits per byte on the first ``--eval-windows`` held-out windows.

    DP group ``d`` scores windows ``d, d + dp, …``; inside an SP group every rank scores its
    own bytes of each window, and one all-reduce over the world adds up the nats and bytes.
    """
    cfg, model, sp = run.cfg, run.raw_model, run.sp
    windows = list(range(min(cfg.eval_windows, len(run.val_data))))[
        run.mesh.dp_rank :: run.mesh.dp_size
    ]
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    for first in range(0, len(windows), run.batch_per_dp):
        items = [run.val_data[i] for i in windows[first : first + run.batch_per_dp]]
        tokens = torch.stack([it["tokens"] for it in items]).to(run.accelerator.device)
        targets = torch.stack([it["targets"] for it in items]).to(run.accelerator.device)
        with run.accelerator.autocast():
            logits = model(tokens, sp=sp, gather_output=False)
        mine = sp.shard_like(targets, logits)
        nats = F.cross_entropy(
            logits.tensor.flatten(0, -2).float(), mine.flatten(), reduction="sum"
        )
        totals += torch.stack([nats.double().cpu(), torch.tensor(float(mine.numel()))])
    model.train()
    if dist.is_available() and dist.is_initialized():
        device = run.accelerator.device
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    return float(totals[0] / totals[1]) / LN2


def checkpoint(run: TrainingRun, step: int, history: list[float], evals: list) -> None:
    """Save a resumable checkpoint at ``step`` with the layout and the loss histories."""
    progress = {
        "seed": run.cfg.seed,
        "global_batch": run.cfg.global_batch,
        "seq_len": run.cfg.seq_len,
        "model": run.cfg.model,
        "layout": layout_of(run.mesh),
        "loss_history": history,
        "evals": evals,
    }
    save_checkpoint(
        run.accelerator,
        run.output_dir / "checkpoints",
        step,
        progress,
        keep=run.cfg.keep_checkpoints,
    )


def finish(run: TrainingRun, step: int, history: list[float], evals: list) -> None:
    """Save the final model when the run is complete; write the loss histories."""
    run.accelerator.wait_for_everyone()
    complete = step >= run.cfg.steps
    final = run.tp.full_model(run.raw_model) if complete else None  # every rank: gathered
    if not run.mesh.is_main:
        return
    if complete:
        from dspzoo.zoo import save_pretrained

        training = {
            "seq_len": run.cfg.seq_len,
            "data": run.cfg.data,
            "steps": step,
            "train_bpb": history[-1] if history else None,
            "val_bpb": evals[-1][1] if evals else None,
        }
        save_pretrained(
            final, run.output_dir / "final", config_name=run.cfg.model, extra={"training": training}
        )
    (run.output_dir / "losses.json").write_text(
        json.dumps({"train_bpb": history, "val_bpb": evals})
    )


def train(cfg: TextTrainConfig) -> dict:
    """Run (or resume) training. Returns on every rank::

    {"losses": this session's bits per byte, "loss_history": all of them from step 1,
     "evals": [[step, validation bits per byte], ...], "tokens_per_s": ...,
     "activation_bytes": ..., "output_dir": ..., "is_main": ...}
    """
    run = setup_run(cfg)
    start_step, history, evals = restore(run) if cfg.resume else (0, [], [])

    def evaluate_now(step: int) -> None:
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            evals.append([step, evaluate(run)])
            if run.mesh.is_main:
                logger.info("step %d validation %.4f bits/byte", step, evals[-1][1])

    settings = LoopSettings.of_run(cfg, start_step, run.tokens_per_step, "bits/byte")
    session = run_training_loop(
        settings,
        run.loader,
        lambda batch, step, meter: training_step(run, batch, meter),
        lambda step, losses: checkpoint(run, step, losses, evals),
        run.model.parameters,
        history,
        run.mesh.is_main,
        logger,
        lambda: run.scheduler.get_last_lr()[0],
        after_step=evaluate_now,
    )
    losses, step, meter_bytes = session.losses, session.step, session.activation_bytes
    history = history + losses
    finish(run, step, history, evals)
    tps = run.tokens_per_step / mean_step_time(session.timings)
    if run.mesh.is_main:
        logger.info(
            "done: %d steps, %.0f tokens/s, activation memory/rank %s (SP %d, %s)",
            step,
            tps,
            format_bytes(meter_bytes),
            run.mesh.sp_size,
            cfg.sp_strategy,
        )
    return {
        "losses": losses,
        "loss_history": history,
        "evals": evals,
        "tokens_per_s": tps,
        "activation_bytes": meter_bytes,
        "output_dir": str(run.output_dir),
        "is_main": run.mesh.is_main,
    }

"""The one training run every domain shares: a :class:`Trainer` drives a domain's :class:`Task`.

``Trainer(task).run()``:

1. checks that the task trains ``--model``'s family (:meth:`Task.check_model`), validates
   the config and builds the accelerator, the dp × sp mesh and the SP context
   (:func:`~dspzoo.core.train.config.start_run`), then the task's data, model and optimizer,
   the warm-up/cosine schedule, the EMA the task asks for, and the SP-aware loader;
2. prepares gradient synchronisation as the strategy says (:class:`GradientSync`: DDP on its
   own communicator, or the tensor-parallel path) — the same for every domain;
3. resumes ``--resume``'s checkpoint from any layout (:func:`resume_from`);
4. runs the loop (:func:`run_training_loop`): one optimisation step per global batch
   (:meth:`Trainer.step`, an :class:`OptimisationStep`), evaluation when the task asks, a checkpoint every
   ``--save-every`` steps, at ``--stop-after`` and after the last step;
5. when the run is complete, saves the final model (EMA weights if any, full tensors) with
   the task's extras, and always ``losses.json``.

Checkpoints record the task's run settings, the layout, the loss and evaluation histories.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..loss import world_report
from ..parallel.trace import SavedTensorMeter, format_bytes
from .checkpoint import save_checkpoint
from .config import record_run_config, start_run, train_loader, warmup_cosine
from .ema import EMA
from .fsdp import ShardingSettings
from .loop import LoopSettings, run_training_loop
from .resume import layout_of, mean_step_time, refuse_stale_checkpoints, resume_from
from .step import OptimisationStep
from .sync import GradientSync
from .task import Task


class Trainer:
    """Runs (or resumes) the training of ``task``; see the module docstring."""

    def __init__(self, task: Task) -> None:
        self.task, self.cfg = task, task.cfg
        self.logger = task.logger
        self.evals: list[list[Any]] = []
        self.final_figures: Any = None

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Accelerator, mesh, data, model, optimizer, schedule, EMA and loader."""
        cfg, task = self.cfg, self.task
        task.check_model(cfg)  # a model the task cannot train: refused before mesh and folder
        accelerator, mesh, sp, output_dir = start_run(cfg)
        self.accelerator, self.mesh, self.sp, self.output_dir = accelerator, mesh, sp, output_dir
        if mesh.is_main:  # the start-up summary: nodes, and where the SP and DP groups lie
            self.logger.info("%s", mesh.describe_topology())
        task.attach(accelerator, mesh, sp, output_dir)
        dataset = task.build_data()
        sharding = (
            ShardingSettings(
                cfg.mixed_precision,
                cfg.activation_checkpointing and not cfg.model_checkpointing(),
                task.fsdp_units,
            )
            if getattr(cfg, "fsdp", False)
            else None
        )
        self.sync = GradientSync(accelerator, mesh, sp, sharding)
        model = self.sync.shard(task.build_model())
        optimizer = task.build_optimizer(model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
        # the scheduler is stepped by hand: Accelerate's wrapper would step it once per process
        self.model, self.optimizer = self.sync.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)
        self.raw_model = accelerator.unwrap_model(self.model)
        decay = task.ema_decay()
        self.ema = EMA(self.raw_model, decay) if decay else None  # of this rank's shards
        if self.ema is not None:
            accelerator.register_for_checkpointing(self.sync.checkpointable(self.ema))
        self.loader = train_loader(cfg, dataset, mesh, **task.loader_options())
        self.optimisation_step = OptimisationStep(
            accelerator, self.model, self.optimizer, self.sync, cfg.grad_clip, self.scheduler,
            self.ema,
        )  # fmt: skip
        self.tokens_per_step = cfg.global_batch * task.tokens_per_sample(self.raw_model)

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def settings(self) -> dict[str, Any]:
        """The task's run settings (what changes the loss sequence), by name."""
        return {key: getattr(self.cfg, key) for key in self.task.run_settings}

    def restore(self) -> tuple[int, list[float]]:
        """Load ``--resume``'s checkpoint (any layout, any strategy); returns ``(step, loss
        history up to it)`` and restores the evaluation history."""
        progress = resume_from(
            self.accelerator,
            self.mesh,
            self.cfg.resume,
            self.checkpoint_dir,
            self.cfg.seed,
            self.settings(),
        )
        step = int(progress["step"])
        self.evals = [e for e in progress.get("evals", []) if e[0] <= step]
        return step, list(progress.get("loss_history", []))[:step]

    def checkpoint(self, step: int, history: list[float]) -> None:
        """Save a resumable checkpoint at ``step`` (collective)."""
        progress = {
            **self.settings(),
            "model": self.cfg.model,
            "layout": layout_of(self.mesh),
            "loss_history": history,
            "evals": self.evals,
        }
        save_checkpoint(
            self.accelerator, self.checkpoint_dir, step, progress, keep=self.cfg.keep_checkpoints
        )

    # -- one step -------------------------------------------------------------------------------
    def step(self, batch: Any, step: int, meter: SavedTensorMeter | None = None) -> float:
        """One optimisation step on this rank's share of global batch ``step``; returns the
        global batch's loss (the task's reported figure). ``meter`` measures the activation
        memory of the loss computation."""
        self.model.train()
        task, model, sp = self.task, self.model, self.sp
        loss = self.optimisation_step(lambda: task.loss(model, batch, step, sp), meter)
        return self.task.report(world_report(loss))

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, step: int) -> Any:
        """The task's evaluation at ``step`` (every rank), kept in the evaluation history."""
        figures = self.task.evaluate(self.raw_model, self.sp, step)
        self.evals = [e for e in self.evals if e[0] != step]
        self.evals.append([step, self.task.eval_summary(figures)])
        if step == self.cfg.steps:
            self.final_figures = figures
        if self.mesh.is_main:
            self.task.log_evaluation(step, figures)
        return figures

    def after_step(self, step: int) -> None:
        if self.task.has_evaluation() and self.task.evaluates_at(step):
            self.evaluate(step)

    # -- the run --------------------------------------------------------------------------------
    def finish(self, step: int, history: list[float], start_step: int) -> None:
        """When the run is complete: the final evaluation if this session has not made it,
        the final model (EMA weights, full tensors) with the task's extras; always
        ``losses.json``."""
        self.accelerator.wait_for_everyone()
        complete = step >= self.cfg.steps
        final = None
        if complete:
            if self.final_figures is None and self.task.has_evaluation():
                if self.task.evaluates_at(step):  # e.g. a finished run resumed as it was
                    self.evaluate(step)
            if self.ema is not None:  # the final model carries the averaged weights
                self.ema.copy_to(self.raw_model)
            final = self.sync.full_model(self.raw_model)  # every rank: shards are gathered
        if not self.mesh.is_main:
            return
        if complete:
            from dspzoo.zoo import save_pretrained

            extra = self.task.final_extra(history, self.evals, self.final_figures)
            save_pretrained(
                final, self.output_dir / "final", config_name=self.cfg.model, extra=extra
            )
        record = self.task.history_record(history, self.evals)
        (self.output_dir / "losses.json").write_text(json.dumps(record))
        self.task.after_finish(history, self.evals, self.final_figures, start_step)

    def run(self) -> dict[str, Any]:
        """Set up, resume, train, finish. Returns on every rank::

        {"losses": this session's losses, "loss_history": all from step 1,
         "evals": [[step, summary], ...], "tokens_per_s", "samples_per_s",
         "activation_bytes", "output_dir", "is_main", ...the task's result_extra}
        """
        self.setup()
        if not self.cfg.resume:
            refuse_stale_checkpoints(self.mesh, self.checkpoint_dir, self.accelerator.device)
        start_step, history = self.restore() if self.cfg.resume else (0, [])
        record_run_config(self.cfg, self.mesh, self.accelerator.device)
        if start_step >= self.cfg.steps and self.mesh.is_main:
            self.logger.warning(
                "the checkpoint is at step %d, at or past --steps %d: nothing to train in this "
                "session (pass --steps > %d to continue the run)",
                start_step,
                self.cfg.steps,
                start_step,
            )
        settings = LoopSettings.of_run(
            self.cfg, start_step, self.tokens_per_step, self.task.loss_name
        )
        # log lines go through the progress bar (written above it), not into its line
        with logging_redirect_tqdm(tqdm_class=tqdm) if self.mesh.is_main else nullcontext():
            session = run_training_loop(
                settings,
                self.loader,
                self.step,
                self.checkpoint,
                lambda: self.sync.local_parameters(self.model),
                history,
                self.mesh.is_main,
                self.logger,
                lambda: self.scheduler.get_last_lr()[0],
                after_step=self.after_step,
            )
        history = history + session.losses
        self.finish(session.step, history, start_step)
        step_time = mean_step_time(session.timings)
        result = {
            "losses": session.losses,
            "loss_history": history,
            "evals": self.evals,
            "tokens_per_s": self.tokens_per_step / step_time,
            "samples_per_s": self.cfg.global_batch / step_time,
            "activation_bytes": session.activation_bytes,
            "output_dir": str(self.output_dir),
            "is_main": self.mesh.is_main,
            **self.task.result_extra(self.final_figures),
        }
        if self.mesh.is_main:
            self._log_done(session.step, start_step, result)
        return result

    def _log_done(self, step: int, start_step: int, result: dict[str, Any]) -> None:
        """The session's last line: how far the run is, its speed and memory, the layout."""
        where = (
            f"{step} steps"
            if step >= self.cfg.steps
            else f"stopped at step {step} of {self.cfg.steps} (--resume latest continues)"
        )
        layout = (
            f"dp {self.mesh.dp_size} × sp {self.mesh.sp_size}, {self.cfg.sp_strategy}, "
            f"gradients: {self.sync.method}"
        )
        if step == start_step:  # no step ran: no speed or memory to report
            self.logger.info("done: %s, no step in this session (%s)", where, layout)
            return
        self.logger.info(
            "done: %s, %.0f tokens/s, %.2f samples/s, activation memory/rank %s (%s)",
            where,
            result["tokens_per_s"],
            result["samples_per_s"],
            format_bytes(result["activation_bytes"]),
            layout,
        )


def train_task(task: Task) -> dict[str, Any]:
    """``Trainer(task).run()``: what every domain's ``train(cfg)`` calls."""
    return Trainer(task).run()

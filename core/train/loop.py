"""The training loop every domain shares: steps from the SP data loader, progress, logs, saves.

A domain supplies one optimisation step (``step_fn(batch, step, meter) -> global-batch loss``)
and how to checkpoint (``save(step, loss_history)``); :func:`run_training_loop` does the rest
the same way everywhere: positions the loader at the step (any layout, after a resume), times
each step, measures activation memory on the session's first step, shows one clearly named
figure — the mean loss over the last ``log_every`` steps — in both the progress bar and the
log, saves every ``save_every`` steps, when ``stop_after`` ends the session and after the
run's last step (so raising ``--steps`` later resumes from it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel.trace import SavedTensorMeter
from ..progress import progress_bar, redraws_in_place
from .resume import mean_step_time


@dataclass
class LoopSettings:
    """How long to run and how often to log and save.

    Attributes:
        steps: total steps of the run, counted from its start.
        start_step: the step a (resumed) session starts at.
        stop_after: end this session after this many steps (with a checkpoint).
        log_every, save_every: periods in steps (``save_every = 0``: only at ``stop_after``
            and the last step).
        tokens_per_step: tokens of one global batch (for tokens/s).
        loss_name: how the loss is called in the logs (``"loss"``, ``"bits/byte"``).
    """

    steps: int
    start_step: int
    stop_after: int | None
    log_every: int
    save_every: int
    tokens_per_step: int
    loss_name: str = "loss"

    @classmethod
    def of_run(
        cls, cfg: Any, start_step: int, tokens_per_step: int, loss_name: str = "loss"
    ) -> LoopSettings:
        """The settings a training config (a :class:`~dspzoo.core.train.config.RunConfig`) asks
        for: its ``steps``, ``stop_after``, ``log_every`` and ``save_every``."""
        return cls(
            steps=cfg.steps,
            start_step=start_step,
            stop_after=cfg.stop_after,
            log_every=cfg.log_every,
            save_every=cfg.save_every,
            tokens_per_step=tokens_per_step,
            loss_name=loss_name,
        )


@dataclass
class LoopResult:
    """What a session did: its last step, its losses and step times, activation bytes."""

    step: int
    losses: list[float] = field(default_factory=list)
    timings: list[float] = field(default_factory=list)
    activation_bytes: int = 0


def run_training_loop(
    settings: LoopSettings,
    loader: Any,
    step_fn: Callable[[Any, int, SavedTensorMeter | None], float],
    save: Callable[[int, list[float]], None],
    parameters: Callable[[], Iterable[torch.nn.Parameter]],
    history: list[float],
    is_main: bool,
    logger: logging.Logger,
    current_lr: Callable[[], float],
    after_step: Callable[[int], None] | None = None,
) -> LoopResult:
    """Run one session of training; see the module docstring.

    ``loader`` has ``set_step`` (:func:`dspzoo.core.sp_dataloader`); ``history`` is the loss
    history before this session (checkpoints carry history + this session's losses);
    ``after_step(step)`` runs after each step (evaluation, …).
    """
    s = settings
    result = LoopResult(step=s.start_step)
    window = s.log_every
    progress = progress_bar(
        total=s.steps,
        initial=s.start_step,
        desc="train",
        disable=not is_main,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    session_over = False
    step = s.start_step
    while step < s.steps and not session_over:
        loader.set_step(step)
        for batch in loader:
            start = time.perf_counter()
            meter = SavedTensorMeter(parameters()) if step == s.start_step else None
            loss = step_fn(batch, step, meter)
            if meter is not None:
                result.activation_bytes = meter.bytes
            step += 1
            result.losses.append(loss)
            result.timings.append(time.perf_counter() - start)
            progress.update(1)
            if after_step is not None:
                after_step(step)
            if step % window == 0 or step == s.steps:
                recent = result.losses[-window:]
                avg = sum(recent) / len(recent)
                step_time = mean_step_time(result.timings, window)
                tps = s.tokens_per_step / step_time
                name = f"{s.loss_name}(avg{len(recent)})"
                progress.set_postfix(  # in a log file the log line below says it
                    {name: f"{avg:.4f}", "tok/s": f"{tps:.0f}"}, refresh=redraws_in_place()
                )
                if is_main:
                    logger.info(
                        "step %d %s %.4f step_time %.3fs tokens/s %.0f lr %.2e",
                        step,
                        name,
                        avg,
                        step_time,
                        tps,
                        current_lr(),
                    )
            session_over = s.stop_after is not None and step - s.start_step >= s.stop_after
            periodic = s.save_every and step % s.save_every == 0
            if periodic or session_over or step >= s.steps:  # the last step always
                save(step, history + result.losses)
            if session_over or step >= s.steps:
                break
    progress.close()
    result.step = step
    return result

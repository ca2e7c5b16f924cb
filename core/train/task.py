"""What a domain supplies to the :class:`~dspzoo.core.train.trainer.Trainer`: a :class:`Task`.

A Task is the domain's part of a training run and nothing else: its config dataclass (every
field a flag, on top of the shared :class:`~dspzoo.core.train.config.RunConfig`), its training
data, its model and optimizer, the per-rank loss of one step under the gradient contract
(:mod:`dspzoo.core.loss`), its evaluation, and what the final model folder stores beside the
weights. Flags shared by all, the mesh, gradient synchronisation, checkpoints, resuming at any
layout, logging, progress and the end of the run are the Trainer's::

    class WeatherTask(Task):
        config_type = WeatherTrainConfig
        name = "weather"
        families = ("weathertx", "weathermamba")     # the model families it trains
        def build_data(self): ...                    # the training dataset
        def build_model(self): ...                   # seeded: identical on every rank
        def loss(self, model, batch, step, sp): ...  # keyed randomness from (seed, step, sample)
        def evaluate(self, model, sp, step): ...     # the held-out figures
        def final_extra(self, history, evals, figures): ...   # saved beside the weights

The Trainer sets :attr:`accelerator`, :attr:`mesh`, :attr:`sp` and :attr:`output_dir` before it
calls any of these (:meth:`Task.attach`); before the mesh exists it checks that ``--model`` is
one of the task's :attr:`~Task.families` (:meth:`Task.check_model`).
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset

from .config import RunConfig


class Task:
    """A domain's part of training; see the module docstring.

    Class attributes:
        config_type: the domain's config dataclass (a :class:`RunConfig`).
        name: the domain's name; its log lines come from ``dspzoo.<name>.train``.
        loss_name: how the reported loss is called in the logs.
        run_settings: config fields that change the loss sequence: recorded in checkpoints,
            and a resumed run that changes one gets a warning naming it.
        families: the zoo model families the task trains; ``--model`` (or ``--init-from``'s
            weights) of another family is refused before the run sets anything up
            (:meth:`check_model`). Empty: not checked (a task building its model itself).
    """

    config_type: ClassVar[type[RunConfig]] = RunConfig
    name: ClassVar[str] = "task"
    loss_name: ClassVar[str] = "loss"
    run_settings: ClassVar[tuple[str, ...]] = ("global_batch", "seed")
    families: ClassVar[tuple[str, ...]] = ()

    accelerator: Any
    mesh: Any
    sp: Any
    output_dir: Path

    def __init__(self, cfg: RunConfig) -> None:
        if not isinstance(cfg, self.config_type):
            raise TypeError(
                f"{type(self).__name__} takes a {self.config_type.__name__}, got "
                f"{type(cfg).__name__}"
            )
        self.cfg = cfg

    @classmethod
    def check_model(cls, cfg: RunConfig) -> None:
        """Refuse a model the task cannot train, before anything is built or written: an
        unknown ``--model`` (the zoo's did-you-mean error) or one of a family not in
        :attr:`families` (``UsageError`` naming the family and the ``dspzoo train`` domain
        that trains it; :func:`~dspzoo.core.train.families.check_trains`)."""
        from .families import check_trains

        check_trains(cls, cfg)

    def attach(self, accelerator: Any, mesh: Any, sp: Any, output_dir: Path) -> None:
        """Called by the Trainer once the mesh exists, before any other method."""
        self.accelerator, self.mesh, self.sp, self.output_dir = accelerator, mesh, sp, output_dir

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"dspzoo.{self.name}.train")

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    # -- what every domain supplies -------------------------------------------------------------
    def build_data(self) -> Dataset:
        """The training dataset (map-style, a pure function of the sample index); the Trainer
        makes the SP-aware loader over it (:func:`~dspzoo.core.train.config.train_loader`)."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """The full model, identical on every rank (seeded from ``cfg.seed`` without touching
        the global RNG), with ``--init-from``'s weights when given."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any, step: int, sp: Any) -> torch.Tensor:
        """This rank's loss of global step ``step`` (counted from 0) under the gradient
        contract: its mean over the dp × sp world is the global batch's loss. Every random
        draw is keyed by ``(seed, step, global sample index)`` (:meth:`first_sample`)."""
        raise NotImplementedError

    # -- optional, with defaults ----------------------------------------------------------------
    def loader_options(self) -> dict[str, Any]:
        """Keyword arguments of the training loader (default: batches moved to the device)."""
        return {"device": self.device}

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with ``--lr`` and ``--weight-decay`` (override for parameter groups)."""
        return torch.optim.AdamW(
            model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )

    def fsdp_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The ``fully_shard`` units under ``--fsdp`` (default: the blocks,
        :func:`~dspzoo.core.train.fsdp.shard_units`)."""
        from .fsdp import shard_units

        return shard_units(model)

    def ema_decay(self) -> float:
        """Decay of the parameter average saved as the final model (0: none)."""
        return 0.0

    def report(self, loss: float) -> float:
        """The logged figure of a global-batch loss (e.g. nats → bits)."""
        return loss

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        """Tokens the model sees per sample, for tokens/s (``model``: the unwrapped one)."""
        return 1

    def evaluate(self, model: torch.nn.Module, sp: Any, step: int) -> Any:
        """Held-out figures after ``step`` (every rank takes part; ``model`` is unwrapped).
        Not overridden: the domain has no evaluation."""
        return None

    def has_evaluation(self) -> bool:
        """Whether the domain overrides :meth:`evaluate`."""
        return type(self).evaluate is not Task.evaluate

    def evaluates_at(self, step: int) -> bool:
        """Whether to evaluate after ``step``: every ``--eval-every`` steps and at the end."""
        every = getattr(self.cfg, "eval_every", 0)
        return bool(every and step % every == 0) or step == self.cfg.steps

    def eval_summary(self, figures: Any) -> Any:
        """What the evaluation history (``[[step, summary], ...]``, in checkpoints) keeps."""
        return figures

    def log_evaluation(self, step: int, figures: Any) -> None:
        """One log line of an evaluation (main process)."""
        self.logger.info("step %d evaluation %s", step, self.eval_summary(figures))

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        """What ``save_pretrained`` stores beside the final weights (``figures``: the
        evaluation at the last step, or ``None``)."""
        return {}

    def history_record(self, history: list[float], evals: list) -> Any:
        """The content of ``<output-dir>/losses.json``."""
        return {"loss_history": history, "evals": evals}

    def after_finish(
        self, history: list[float], evals: list, figures: Any, start_step: int
    ) -> None:
        """Main process, after the final model and ``losses.json``: plots, reports."""

    def result_extra(self, figures: Any) -> dict[str, Any]:
        """Domain entries of the dict ``train`` returns."""
        return {}

    # -- helpers for keyed randomness ------------------------------------------------------------
    @property
    def batch_per_dp(self) -> int:
        return self.cfg.global_batch // self.mesh.dp_size

    def first_sample(self, step: int) -> int:
        """Global index of this DP group's first sample at ``step``: samples are numbered
        from the start of training, ``global_batch`` per step, the same at every layout."""
        return step * self.cfg.global_batch + self.mesh.dp_rank * self.batch_per_dp

    def samples(self, step: int) -> range:
        """Global indices of this DP group's samples at ``step``."""
        first = self.first_sample(step)
        return range(first, first + self.batch_per_dp)


def with_batch_offset(sp: Any, batch_offset: int) -> Any:
    """``sp`` whose keyed dropout numbers the local batch's samples from ``batch_offset``.

    For a model that calls ``sp.dropout(act, p, key=...)`` without a ``batch_offset``: the
    masks then depend on the global sample index, not on the DP group's local one, so they are
    the same at every dp × sp layout. A shallow copy (plans and groups shared).
    """
    view = copy.copy(sp)
    view.dropout = functools.partial(sp.dropout, batch_offset=batch_offset)
    return view

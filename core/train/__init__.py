"""dspzoo.core.train: one :class:`Trainer` for every domain, which supplies a :class:`Task`.

The pieces: the shared flags and run config (:mod:`.config`, :mod:`.flags`), the loop
(:mod:`.loop`), durable checkpoints (:mod:`.checkpoint`) and resuming at any layout
(:mod:`.resume`), the strategy's gradient synchronisation (:mod:`.sync`), the EMA
(:mod:`.ema`), and the Task protocol (:mod:`.task`) the Trainer (:mod:`.trainer`) drives.
"""

from .config import (
    RunConfig,
    load_initial_weights,
    record_run_config,
    start_run,
    train_loader,
    warmup_cosine,
)
from .ema import EMA
from .flags import TrainingCLI, check_values, flag
from .step import OptimisationStep
from .sync import GradientSync, gradient_group
from .task import Task, with_batch_offset
from .trainer import Trainer, train_task

__all__ = [
    "EMA",
    "GradientSync",
    "OptimisationStep",
    "RunConfig",
    "Task",
    "Trainer",
    "TrainingCLI",
    "check_values",
    "flag",
    "gradient_group",
    "load_initial_weights",
    "record_run_config",
    "start_run",
    "train_loader",
    "train_task",
    "warmup_cosine",
    "with_batch_offset",
]

"""Moved to :mod:`dspzoo.core.train.checkpoint`; this name stays importable."""

from .train.checkpoint import (  # noqa: F401
    PROGRESS_FILE,
    complete_checkpoints,
    latest_checkpoint,
    read_progress,
    recover_interrupted_save,
    save_checkpoint,
)

"""Moved to :mod:`dspzoo.core.train.config`; this name stays importable."""

from .train.config import (  # noqa: F401
    NOT_WIRED,
    RunConfig,
    load_initial_weights,
    start_run,
    train_loader,
    warmup_cosine,
)

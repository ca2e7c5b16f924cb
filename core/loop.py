"""Moved to :mod:`dspzoo.core.train.loop`; this name stays importable."""

from .train.loop import LoopResult, LoopSettings, run_training_loop  # noqa: F401

"""Moved to :mod:`dspzoo.core.train.ema`; this name stays importable."""

from .train.ema import EMA  # noqa: F401

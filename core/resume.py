"""Moved to :mod:`dspzoo.core.train.resume`; this name stays importable."""

from .train.resume import find_checkpoint, layout_of, mean_step_time, resume_from  # noqa: F401

"""Moved to :mod:`dspzoo.core.train.flags`; this name stays importable."""

from .train.flags import TrainingCLI, build_parser, check_values, flag, parse_bool, parse_config  # noqa: F401

"""Sequence-parallel strategies, chosen at run time by name."""

from __future__ import annotations

from .base import Strategy, local_attention
from .dsp import DSP

STRATEGIES: dict[str, type[Strategy]] = {"dsp": DSP}


def get_strategy(name: str) -> Strategy:
    """Instantiate the strategy called ``name``."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {sorted(STRATEGIES)}") from None


__all__ = ["DSP", "STRATEGIES", "Strategy", "get_strategy", "local_attention"]

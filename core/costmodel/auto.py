"""``strategy="auto"`` lives in the parallel layer (:mod:`dspzoo.core.parallel.strategies.auto`), priced
from the method registry; this name is kept for code that imported it from here."""

from __future__ import annotations

from ..parallel.strategies.auto import Auto, auto_plan

__all__ = ["Auto", "auto_plan"]

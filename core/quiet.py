"""One voice per launch: what every rank would log alike is logged once, and expected notes
of the libraries are recognised instead of repeated at every checkpoint.

* :func:`first_of_launch`: whether this process speaks for the launch (``RANK`` unset or 0).
* :class:`FirstRankOnly`: a logging filter for lines that are the same on every rank (the
  opt-in glibc malloc line of :func:`dspzoo.core.accelerate.setup_accelerate`, argument
  errors).
* :class:`TiedWeightsNote`: Accelerate's ``save_state`` writes safetensors, which cannot hold
  one tensor under two names, so it drops the second name of a tied weight and warns "Removed
  shared tensor {'head.weight'} while saving … check … while reloading" at every checkpoint.
  For a weight the model ties *itself* (one ``Parameter`` registered under two names, e.g. a
  byte LM's output head sharing the embedding) that is expected and harmless: the model built
  for ``load_state`` ties them again, so loading the one saved tensor restores both. The
  filter drops the warning only when every removed name is such an alias in a model the
  accelerator prepared; any other shared tensor still warns.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by whoever passes a model: not by the CLI's parser
    from torch import nn

ACCELERATE_SAVE_LOGGER = "accelerate.utils.other"
_REMOVED = re.compile(r"Removed shared tensor (\{.*?\}) while saving")


def first_of_launch() -> bool:
    """Whether this process speaks for the launch: rank 0, or a process launched alone."""
    return os.environ.get("RANK", "0") in ("", "0")


class FirstRankOnly(logging.Filter):
    """Pass records on the first rank of a launch only (for lines every rank logs alike)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return first_of_launch()


def aliased_names(model: nn.Module) -> set[str]:
    """Names under which a parameter of ``model`` is registered a second (third, …) time: the
    ones a state dict holds twice for one tensor (``head.weight`` of a tied head)."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


class TiedWeightsNote(logging.Filter):
    """Drop Accelerate's "Removed shared tensor" warning when every name it removed is an alias
    of a parameter in a model ``accelerator`` prepared (module docstring)."""

    def __init__(self, accelerator: Any) -> None:
        super().__init__()
        self._accelerator = weakref.ref(accelerator)

    def _aliases(self) -> set[str]:
        accelerator = self._accelerator()
        if accelerator is None:
            return set()
        names: set[str] = set()
        for model in getattr(accelerator, "_models", []):
            names |= aliased_names(accelerator.unwrap_model(model))
        return names

    def filter(self, record: logging.LogRecord) -> bool:
        match = _REMOVED.search(record.getMessage())
        if match is None:
            return True
        try:
            removed = ast.literal_eval(match.group(1))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(removed, set) and removed and removed <= self._aliases())


def recognise_tied_weights(accelerator: Any) -> None:
    """Filter Accelerate's note on tied weights for the models ``accelerator`` prepares
    (:class:`TiedWeightsNote`; replaces the filter of an earlier accelerator)."""
    saver = logging.getLogger(ACCELERATE_SAVE_LOGGER)
    for f in list(saver.filters):
        if isinstance(f, TiedWeightsNote):
            saver.removeFilter(f)
    saver.addFilter(TiedWeightsNote(accelerator))

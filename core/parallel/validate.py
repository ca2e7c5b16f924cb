"""Input validation that every rank of a group agrees on: one rank's bad input fails them all.

A model entering the sharded region validates its inputs locally; if only one rank rejected
them and raised, its peers would block in the next collective until the timeout. Instead
:func:`validate_collectively` runs the local check on every rank, and:

* a rank that accepts its input sends nothing: the outcome travels with the group's next
  agreement — the runtime's entry agreement (:meth:`~dspzoo.core.parallel.runtime.SeqParallel.enter`),
  which it makes anyway, so a valid forward costs no exchange of its own;
* a rank that rejects its input agrees at once; the other ranks meet it in their next
  agreement, and every rank raises the same :class:`InputValidationError` naming the ranks and
  what was wrong.

Call it before the sharded region's entry (or before any other collective of the group): a
collective that is not an agreement (a bare all-reduce) would not meet the rejecting rank.
Inside an agreed forward (after the entry), the outcome is settled at once, with one exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .comm import group_size
from .comm.agreement import (
    InputValidationError,
    Signature,
    agree_in_full,
    is_trusted,
    owe_validation,
    settle_validation,
)
from .comm.settings import SETTINGS

__all__ = ["InputValidationError", "validate_collectively"]


def validate_collectively(
    check: Callable[[], None],
    group: Any,
    what: str = "inputs",
    device: str | torch.device = "cpu",
) -> None:
    """Run ``check()`` on every rank of ``group``; if it raises anywhere, raise everywhere.

    Args:
        check: raises ``ValueError`` or ``TypeError`` with a clear message for bad input.
        group: the process group (``None``: one process, the local error is raised as is).
        what: what is being validated, for the message (e.g. ``"STDiT inputs"``).
        device: where the group's tensors live (used only by a group without a host side
            group for its agreements).

    Other exceptions from ``check`` propagate unchanged (they are bugs, not input errors).
    """
    error: Exception | None = None
    try:
        check()
    except (ValueError, TypeError) as exc:
        error = exc
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    if error is None:
        owe_validation(group, what)
        if is_trusted(group) or SETTINGS.debug:  # no entry agreement follows: settle now
            settle_validation(group, device)
        return
    sig = Signature("validate")
    sig.what, sig.error = what, error
    agree_in_full(sig, group, device)  # raises InputValidationError on every rank
    raise AssertionError("unreachable: a rejected input raises in its agreement")

"""Input validation that every rank of a group agrees on: one rank's bad input fails them all.

A model entering the sharded region validates its inputs locally; if only one rank rejected
them and raised, its peers would block in the next collective until the timeout. Instead every
rank runs the local check and the ranks agree on the outcome in one tiny exchange on the host;
when some rank failed, every rank raises the same :class:`InputValidationError` naming the
ranks and what was wrong.

A model's forward passes its check to its entry agreement
(``sp.enter(..., check=...)`` or ``sp.agree_entry(..., check=...)``), which makes that exchange
anyway: a valid forward then costs nothing more. :func:`validate_collectively` is the same check
on its own (one exchange), for anything else — a check inside the region, a run's output
folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .comm import group_size
from .comm.agreement import InputValidationError, Signature, agree_in_full

__all__ = ["InputValidationError", "local_outcome", "validate_collectively"]


def local_outcome(check: Callable[[], None] | None) -> Exception | None:
    """The bad-input error ``check()`` raises on this rank (``ValueError``/``TypeError``), or
    ``None``; other exceptions propagate (they are bugs, not input errors)."""
    if check is None:
        return None
    try:
        check()
    except (ValueError, TypeError) as exc:
        return exc
    return None


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

    Costs one tiny exchange on the host (the group's control side group). Other exceptions
    from ``check`` propagate unchanged (they are bugs, not input errors).
    """
    error = local_outcome(check)
    if group_size(group) == 1:
        if error is not None:
            raise error
        return
    sig = Signature("validate")
    sig.what, sig.error = what, error
    agree_in_full(sig, group, device)  # raises InputValidationError on every rank if any failed

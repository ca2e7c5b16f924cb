"""Input validation that every rank of a group agrees on: one rank's bad input fails them all.

A model entering the sharded region validates its inputs locally; if only one rank rejected
them and raised, its peers would block in the next collective until the timeout. Instead
:func:`validate_collectively` runs the local check on every rank, agrees on the outcome with
one tiny all-reduce, and — only when some rank failed — shares the messages so that every
rank raises the same :class:`InputValidationError` naming the ranks and what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .comm import group_rank, group_size
from .trace import record_comm


class InputValidationError(ValueError):
    """Inputs rejected on one or more ranks of a group; raised on every rank of it."""


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
        device: where the one-element flag lives (a CUDA device under NCCL).

    Costs one 4-byte all-reduce when every rank accepts its input. Other exceptions from
    ``check`` propagate unchanged (they are bugs, not input errors).
    """
    error: Exception | None = None
    try:
        check()
    except (ValueError, TypeError) as exc:
        error = exc
    n = group_size(group)
    if n == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    record_comm("validate", 2 * (n - 1) * 4 // n, n, flag, phase="forward", region=None)
    if int(flag.item()) == 0:
        return
    messages: list[Any] = [None] * n
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(messages, mine, group=group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
    raise InputValidationError(
        f"{what} rejected on SP rank(s) {[r for r, _ in failed]} of {n} "
        f"(this is rank {group_rank(group)}): {detail}"
    ) from error

"""``check_consistent``: an explicit cross-rank check of a tensor and call arguments.

The primitives agree on their own arguments (:mod:`.agreement`); this is the same agreement
for user code that wants to assert, before its own collective, that every rank passes the same
arguments and a tensor of the same dtype and shape (up to the ``free_axes``).
"""

from __future__ import annotations

from typing import Any

import torch

from .agreement import Signature, agree_in_full


def check_consistent(
    x: torch.Tensor,
    group: Any,
    what: str,
    args: tuple[int, ...] = (),
    free_axes: tuple[int, ...] = (),
) -> None:
    """Raise the same ``CollectiveInputError`` on every rank if ranks disagree.

    ``args`` are call arguments (dims, lengths) that must be equal; ``free_axes`` are the axes
    whose sizes legitimately differ per rank (shards). ``what`` names the caller in the message.
    """
    sig = Signature("check_consistent")
    for i, value in enumerate(args):
        sig.arg(f"{what} arg {i}", value)
    sig.tensor(what, x, sharded=tuple(a % max(x.dim(), 1) for a in free_axes))
    agree_in_full(sig, group, x.device)  # always: user code is never a trusted call

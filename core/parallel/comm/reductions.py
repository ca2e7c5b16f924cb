"""Small reductions for counts and metrics (no autograd), guarded like every collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .agreement import guard
from .group import group_size, record


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (no autograd; for counts and metrics)."""
    if group_size(group) == 1:
        return x
    x = x.detach().clone()
    with guard("all_reduce_sum", group, None, x.device):
        dist.all_reduce(x, group=group)
    n = group_size(group)
    record("all_reduce", 2 * (n - 1) * x.numel() * x.element_size() // n, group, x, "forward", None)
    return x

"""Group queries, the control side group of each data group, argument normalisation, tracing.

**Control side group.** Agreements (:mod:`.agreement`) are a few ``int64`` words per rank. On a
group whose backend moves CPU tensors (gloo, or torch's ``cpu:gloo,cuda:nccl`` default) they
travel on the group itself as CPU tensors. A group on NCCL alone gets a gloo group over the same
ranks beside it (:func:`register_control_group`, done by
:func:`dspzoo.core.parallel.mesh.own_group` for every group a mesh builds), so an agreement never
puts a small collective on the data communicator and never reads device memory back to the host.
A NCCL-only group without one (a group the user built) still agrees, over the data group with
device tensors: correct, with one host synchronisation per agreement.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..trace import record_comm

# the single-tensor collectives under their current and older names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_CONTROL: dict[int, tuple[Any, Any]] = {}  # id(data group) -> (data group, control group)


def register_control_group(group: Any, control: Any) -> None:
    """Agreements of ``group`` travel on ``control`` (a gloo group over the same ranks)."""
    _CONTROL[id(group)] = (group, control)  # holding the group keeps its id from being reused


def control_group(group: Any) -> tuple[Any, bool]:
    """``(group to agree on, whether it moves CPU tensors)`` for data group ``group``."""
    entry = _CONTROL.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1], True
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # not a registered process group (tests' fakes)
        return group, True
    return group, moves_cpu_tensors(backend)


def moves_cpu_tensors(backend: str) -> bool:
    """Whether a group on ``backend`` (``dist.get_backend``'s string) moves CPU tensors: gloo,
    or torch's ``cpu:gloo,cuda:nccl`` default; not NCCL alone."""
    return "gloo" in backend or "cpu:" in backend


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (``None`` means a one-rank group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank inside ``group``."""
    return 0 if group is None else dist.get_rank(group)


def norm_dim(x: torch.Tensor, dim: int, what: str) -> int:
    """``dim`` as a non-negative axis of ``x``; a clear error when it is out of range."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def record(
    op: str, bytes_sent: int, group: Any, x: torch.Tensor, phase: str, region: str | None
) -> None:
    """Report one collective to the active tracer (see :mod:`dspzoo.core.parallel.trace`)."""
    record_comm(op, bytes_sent, group_size(group), x, phase=phase, region=region)

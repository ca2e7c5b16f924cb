"""Losses under the gradient contract.

**Gradient contract.** Every collective's backward is the exact adjoint of its forward over
the SP group, and each SP rank's loss is normalised so that the *mean* of the per-rank losses
over the SP group equals the full-sample loss. Averaging parameter gradients over the whole
dp × sp world (what DDP and FSDP do by default) then gives exactly the data-parallel average of
single-process gradients — for parameters used before the split, inside the sharded region and
after the gather alike.

* A loss on *replicated* data (after :func:`~dspzoo.core.parallel.comm.gather`) is computed as usual on
  every rank: its mean over the group is itself.
* A loss on *sharded* tokens uses :func:`sp_mean`: rank ``r`` returns
  ``N · Σ_{own tokens} ℓ / (global token count)``, whose mean over the group is the global
  mean, uneven shards included.
"""

from __future__ import annotations

from typing import Any

import torch

from .parallel.comm import all_reduce_sum, group_size


def sp_mean(values: torch.Tensor, group: Any, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-rank share of the global (weighted) mean of ``values`` over the SP group.

    Args:
        values: this rank's per-element losses, any shape and floating dtype.
        group: the SP process group (``None``: single process, plain mean).
        weight: optional per-element weights or 0/1 mask broadcastable to ``values``.

    Returns a scalar ``N · Σ w·ℓ / Σ_group w``; its mean over the group is the global mean.
    The denominator is summed with one small all-reduce (no gradient flows through it).
    Sums are accumulated in at least float32 and counts in float64 whatever the input dtype,
    so half-precision inputs with more than 65,504 elements neither overflow nor round the
    count; the result has dtype ``promote_types(values.dtype, float32)``.
    """
    acc = torch.promote_types(values.dtype, torch.float32)
    if weight is None:
        local_sum = values.sum(dtype=acc)
        local_count = torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device)
    else:
        weight = weight.expand_as(values)
        local_sum = (values.to(acc) * weight.to(acc)).sum()
        local_count = weight.detach().to(torch.float64).sum()
    n = group_size(group)
    total = float(all_reduce_sum(local_count, group))
    if total == 0.0:
        raise ValueError("sp_mean: the global weight (token count) is zero; nothing to average")
    return local_sum * (n / total)


def sp_mse(
    prediction: torch.Tensor, target: torch.Tensor, group: Any, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error over all elements of a sharded prediction (see :func:`sp_mean`)."""
    if prediction.shape != target.shape:
        raise ValueError(
            f"sp_mse: prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ"
        )
    return sp_mean((prediction - target).pow(2), group, weight)


def sp_report(loss: torch.Tensor, group: Any) -> float:
    """The full-sample value of a per-rank loss (its mean over the group), for logging."""
    return float(all_reduce_sum(loss.detach().double().reshape(1), group)) / group_size(group)


def world_report(loss: torch.Tensor, world_group: Any = None) -> float:
    """The global-batch value of a per-rank loss: its mean over every rank (dp × sp), for logging.

    Under the gradient contract the mean over an SP group is that group's batch loss, and DP
    groups hold equal batches, so the mean over the world is the loss of the global batch —
    the same figure whatever the dp × sp layout. Without ``torch.distributed`` it is ``loss``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return float(loss.detach())
    group = dist.group.WORLD if world_group is None else world_group
    return float(all_reduce_sum(loss.detach().double().reshape(1), group)) / dist.get_world_size(
        group
    )

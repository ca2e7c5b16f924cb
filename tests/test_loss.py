"""Losses under the gradient contract: half-precision inputs and sharded means."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.loss import sp_mean, sp_mse, sp_report, world_report
from dspzoo.core.parallel.layout import shard_offset, shard_sizes
from dspzoo.core.testing import run_distributed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sp_mean_of_many_half_precision_values(dtype: torch.dtype) -> None:
    # 100,001 elements: more than fp16's largest finite value, and a count bf16 cannot hold
    values = torch.full((100_001,), 0.5, dtype=dtype)
    assert float(sp_mean(values, None)) == pytest.approx(0.5, rel=1e-6)
    weight = torch.ones(100_001, dtype=dtype)
    weight[:1] = 0
    assert float(sp_mean(values, None, weight)) == pytest.approx(0.5, rel=1e-6)
    pred = torch.full((300, 400), 1.0, dtype=dtype, requires_grad=True)
    loss = sp_mse(pred, torch.zeros(300, 400, dtype=dtype), None)
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(1.0)
    loss.backward()
    assert torch.isfinite(pred.grad.float()).all()


def test_sp_mean_keeps_float64() -> None:
    assert sp_mean(torch.ones(3, dtype=torch.float64), None).dtype == torch.float64


def _sharded_half_mean(rank: int, world: int) -> float:
    torch.manual_seed(0)
    full = torch.rand(7, 20_000, dtype=torch.float64)  # 140k elements, 7 rows over 2..4 ranks
    offset, size = shard_offset(7, world, rank), shard_sizes(7, world)[rank]
    local = full[offset : offset + size].half()
    loss = sp_mean(local, dist.group.WORLD)
    assert sp_report(loss, dist.group.WORLD) == pytest.approx(float(full.half().double().mean()))
    assert world_report(loss) == pytest.approx(float(full.half().double().mean()))
    return float(loss)


@pytest.mark.parametrize("world", [3])
def test_sharded_half_precision_mean_matches_single_process(world: int) -> None:
    losses = run_distributed(_sharded_half_mean, world)
    assert sum(losses) / world == pytest.approx(
        float(
            torch.rand(7, 20_000, dtype=torch.float64, generator=torch.manual_seed(0))
            .half()
            .double()
            .mean()
        )
    )

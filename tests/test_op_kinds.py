"""Stages that are not attention run exactly under every strategy (issue: op kinds).

A video model with a depthwise Conv1d along ``t`` and a 2-D model with row, column and full
2-D attention plus a pooling stage (examples/mixing_ops.py), on lengths that SP 2, 3 and 4 do
not divide: outputs, every parameter gradient and every rank's traced bytes equal one process
and the plan under every strategy (the public harness). A conv stage declared as attention is
refused on every rank at its first forward instead of returning wrong numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspzoo.core import SeqParallel, Stage
from dspzoo.core.harness import check_model
from dspzoo.core.parallel.plan import plan_fixed, plan_stages
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.core.testing import run_distributed
from dspzoo.examples import mixing_ops
from dspzoo.examples.mixing_ops import ConvVideo, Grid2D, MixerConfig, mixer_workload

CFG = MixerConfig(hidden=16, heads=4, depth=2)
T, S = 5, 7  # conv video tokens: no SP size in 2..4 divides either
H, W = 5, 7


def make_conv_video() -> nn.Module:
    return ConvVideo(CFG)


def make_grid() -> nn.Module:
    return Grid2D(CFG)


def conv_inputs() -> torch.Tensor:
    return torch.randn(2, T, S, 3, generator=torch.Generator().manual_seed(1))


def grid_inputs() -> torch.Tensor:
    return torch.randn(2, H, W, 3, generator=torch.Generator().manual_seed(2))


def test_generic_stages_get_their_dims_whole_under_every_strategy() -> None:
    for name in STRATEGIES:
        if name == "dsp":
            plan = plan_stages(("t", "s"), (T, S), mixing_ops.CONV_STAGES, 2)
        else:
            method = "ring" if name == "ring_zigzag" else name
            layout = "zigzag" if name == "ring_zigzag" else "contiguous"
            plan = plan_fixed(
                ("t", "s"), (T, S), mixing_ops.CONV_STAGES, 2, method, "t", layout=layout
            )
        conv = plan.step_for("conv")
        assert conv.sharded != "t" or conv.method == "gather", (name, str(plan))
        assert conv.method in ("local", "gather")
    # a generic stage that mixes every dim is gathered whole, never run by an attention method
    plan = plan_fixed(("h", "w"), (H, W), mixing_ops.GRID_STAGES, 3, "ulysses")
    assert plan.method_for("pool@0") == plan.method_for("pool@1") == "gather"
    assert plan.method_for("row@0") == "ulysses" and plan.method_for("col@0") == "local"
    dsp = plan_stages(("h", "w"), (H, W), mixing_ops.GRID_STAGES, 3)
    assert dsp.method_for("full@1") == "ulysses" and dsp.method_for("pool@1") == "gather"


@pytest.mark.timeout(300)
def test_conv_video_is_exact_under_every_strategy_at_sp_2_3_4() -> None:
    wl = mixer_workload("conv_video", CFG, 2, (T, S))
    report = check_model(make_conv_video, conv_inputs, workload=wl, timeout=280)
    assert {c.strategy for c in report.checks} == set(STRATEGIES)
    assert all(c.plan_bytes == c.traced_bytes for c in report.checks)
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


@pytest.mark.timeout(300)
def test_grid_with_full_attention_and_pooling_is_exact_under_every_strategy() -> None:
    wl = mixer_workload("grid2d", CFG, 2, (H, W))
    report = check_model(make_grid, grid_inputs, workload=wl, timeout=280)
    assert {c.strategy for c in report.checks} == set(STRATEGIES)
    assert all(c.plan_bytes == c.traced_bytes for c in report.checks)
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


class MislabelledConv(ConvVideo):
    """The conv stage declared as attention (the default op kind): wrong under Ring."""

    STAGES = (Stage("spatial", ("s",)), Stage("conv", ("t",)), Stage("mlp"))


def _mislabelled(rank: int, world: int) -> str:
    from dspzoo.core import build_mesh

    torch.manual_seed(0)
    model = MislabelledConv(CFG)
    sp = SeqParallel(build_mesh(world), "ring", dim="t")
    try:
        model(conv_inputs(), sp=sp)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_a_stage_that_never_calls_its_method_raises_on_every_rank(world: int) -> None:
    messages = run_distributed(_mislabelled, world, timeout=100)
    assert len(set(messages)) == 1, messages
    assert "stage 'conv' was planned to run with 'ring'" in messages[0]
    assert "op='generic'" in messages[0]

"""Why a token-wise stage after a ``raster(t,h,w)`` scan may switch: lost compute, not a rule.

A token-wise stage (an MLP: ``mixes=()``) may run on any dim. The planner keeps the current
one unless another balances the ranks by more than the switches cost, at
``Pricing.compute_weight`` per element of lost compute. These tests pin that trade on the
video Mamba DiT's raster layer (``scan0`` over every dim, then ``mlp``).
"""

from __future__ import annotations

import pytest

from dspzoo.core.parallel.plan import Stage, plan_stages
from dspzoo.core.parallel.planner import ActShape, Pricing, plan_problem
from dspzoo.domains.mamba.video import VideoMambaConfig, layer_stages

DIMS = ("t", "h", "w")
RASTER = layer_stages(VideoMambaConfig(orders=("raster(t,h,w)",)))


def _stay_and_switch_costs(lengths: tuple[int, ...], n: int, weight: float) -> tuple[float, float]:
    """The cost of one layer with the MLP left on ``t`` and with it on the cheapest other dim."""
    problem = plan_problem(
        {"x": ActShape(DIMS, lengths, 1)},
        [s.as_multi() for s in RASTER],
        n,
        pricing=Pricing(weight),
    )
    scan = next(o for o in problem.options[0] if o[0][0] == "t")
    stay = problem.cost([scan, (("t", "local"),)])
    moved = min(
        problem.cost([scan, ((d, "local"),)])
        for d in ("h", "w")
        if ((d, "local"),) in problem.options[1]
    )
    return stay, moved


def test_the_raster_layer_shape_is_what_the_model_declares() -> None:
    assert [(s.name, s.mixes, s.op) for s in RASTER] == [
        ("scan0", DIMS, "scan"),
        ("mlp", (), "attention"),
    ]


@pytest.mark.parametrize(("lengths", "n"), [((4, 8, 8), 2), ((4, 8, 8), 4), ((6, 5, 7), 3)])
def test_the_mlp_keeps_the_scan_sharding_when_the_ranks_are_balanced(
    lengths: tuple[int, ...], n: int
) -> None:
    plan = plan_stages(DIMS, lengths, RASTER, n)
    assert plan.switches_per_period == 0, str(plan)
    assert plan.sharded_for("mlp") == plan.sharded_for("scan0") == "t"


@pytest.mark.parametrize(("lengths", "n"), [((5, 3, 5), 3), ((5, 3, 5), 4)])
def test_the_switch_is_the_priced_balance_trade(lengths: tuple[int, ...], n: int) -> None:
    # the two switches cost a fixed number of elements; the lost compute they save grows
    # linearly with the weight: find the weight where the two cost the same
    s1, m1 = _stay_and_switch_costs(lengths, n, 1.0)
    s2, m2 = _stay_and_switch_costs(lengths, n, 2.0)
    gain = (s2 - s1) - (m2 - m1)  # lost compute the switch saves per unit of weight
    assert gain > 0
    threshold = ((m1 - s1) + gain * 1.0) / gain
    for weight, switches in ((threshold * 0.95, 0), (threshold * 1.05, 2)):
        plan = plan_stages(DIMS, lengths, RASTER, n, pricing=Pricing(weight))
        assert plan.switches_per_period == switches, (weight, str(plan))
        assert plan.sharded_for("scan0") == "t"
    # the default weight (16) lies above the threshold at these shapes: 2 switches
    assert threshold < Pricing().compute_weight
    assert plan_stages(DIMS, lengths, RASTER, n).switches_per_period == 2


def test_an_idle_rank_makes_a_token_wise_stage_switch_whatever_the_weight_above_two() -> None:
    # the example: one frame at SP 2 leaves a rank idle through an MLP left on t
    stages = (Stage("mlp"), Stage("spatial", ("s",)))
    plan = plan_stages(("t", "s"), (1, 8), stages, 2, pricing=Pricing(2.5))
    assert plan.sharded_for("mlp") == "s" and plan.switches_per_period == 2, str(plan)

"""The switch-schedule planner."""

from __future__ import annotations

import pytest

from dspzoo.core import Stage, plan_stages

STDIT = (Stage("spatial", ("s",)), Stage("temporal", ("t",)), Stage("cross"), Stage("mlp"))
AXIAL_3D = (Stage("attn_t", ("t",)), Stage("attn_h", ("h",)), Stage("attn_w", ("w",)), Stage("mlp"))


def test_2d_spatial_temporal_needs_two_switches_per_layer() -> None:
    plan = plan_stages(("t", "s"), (16, 256), STDIT, sp_size=4)
    assert plan.switches_per_period == 2
    assert plan.sharded_for("spatial") == "t"
    assert plan.sharded_for("temporal") == "s"
    assert plan.entry == "t"
    assert "2 switch(es) per layer" in str(plan)


def test_3d_axial_attention_needs_two_switches_not_three() -> None:
    plan = plan_stages(("t", "h", "w"), (8, 16, 16), AXIAL_3D, sp_size=4)
    assert plan.switches_per_period == 2
    # whatever shards the t-stage must also survive... t is sharded through both h and w
    assert plan.sharded_for("attn_h") == plan.sharded_for("attn_w") == "t"
    assert plan.sharded_for("attn_t") in ("h", "w")


def test_switch_bytes_formula() -> None:
    plan = plan_stages(("t", "s"), (16, 256), STDIT, sp_size=4)
    m = 2 * 16 * 256 * 64
    assert plan.switch_bytes_per_period(m, 4) == 2 * (m / 4) * (3 / 4) * 4


def test_prefers_divisible_dims() -> None:
    stages = (Stage("attn_t", ("t",)), Stage("mlp"))
    plan = plan_stages(("t", "h", "w"), (8, 6, 8), stages, sp_size=4)
    assert plan.sharded_for("attn_t") == "w"  # h=6 is not divisible by 4
    assert plan.switches_per_period == 0


def test_dims_too_short_to_shard_are_avoided_or_flagged() -> None:
    # t = 1 cannot feed 2 ranks: only forced when it is the only choice, and then flagged
    plan = plan_stages(("t", "s"), (1, 64), STDIT, sp_size=2)
    assert plan.sharded_for("temporal") == "s"
    step = next(s for s in plan.steps if s.stage == "spatial")
    assert step.sharded == "t" and "idle" in step.note
    # with a long enough alternative, the short dim is never chosen
    plan3 = plan_stages(("t", "h", "w"), (1, 16, 16), AXIAL_3D, sp_size=4)
    assert all(s.sharded != "t" for s in plan3.steps)


def test_unknown_dim_raises() -> None:
    with pytest.raises(ValueError, match="unknown dim"):
        plan_stages(("t", "s"), (4, 4), (Stage("x", ("z",)),), sp_size=2)
    with pytest.raises(ValueError, match="method must be one of"):
        Stage("full", ("t", "s"), method="magic")


HYBRID = (
    Stage("spatial", ("s",)),
    Stage("temporal", ("t",)),
    Stage("mlp"),
    Stage("full", ("t", "s")),
    Stage("mlp2"),
)


def test_hybrid_places_an_embedded_method_exactly_on_all_dim_stages() -> None:
    plan = plan_stages(("t", "s"), (16, 256), HYBRID, sp_size=4)
    assert plan.methods == {
        "spatial": "local",
        "temporal": "local",
        "mlp": "local",
        "full": "ulysses",  # 4 switch units beat ring's 2N = 8
        "mlp2": "local",
    }
    # the all-dim stage stays on the dim the axial stages left sharded: no extra switch
    assert plan.switches_per_period == 2
    assert "Hybrid DSP + ulysses" in str(plan)
    # fewer heads than ranks: ring; a forced method wins
    few_heads = (*HYBRID[:3], Stage("full", ("t", "s"), heads=2), HYBRID[4])
    assert plan_stages(("t", "s"), (16, 256), few_heads, sp_size=4).method_for("full") == "ring"
    forced = (*HYBRID[:3], Stage("full", ("t", "s"), method="lss"), HYBRID[4])
    assert plan_stages(("t", "s"), (16, 256), forced, sp_size=4).method_for("full") == "lss"


def test_one_dim_model_under_dsp_is_all_embedded() -> None:
    plan = plan_stages(("l",), (100,), (Stage("attn", ("l",)), Stage("mlp")), sp_size=4)
    assert plan.methods == {"attn": "ulysses", "mlp": "local"} and plan.switches_per_period == 0


def test_fixed_dim_strategies_shard_one_dim_throughout() -> None:
    from dspzoo.core.parallel.plan import plan_fixed

    plan = plan_fixed(("t", "s"), (16, 256), STDIT, sp_size=4, method="ring")
    assert {s.sharded for s in plan.steps} == {"s"} and plan.switches_per_period == 0
    assert plan.methods == {
        "spatial": "ring",
        "temporal": "local",
        "cross": "local",
        "mlp": "local",
    }
    plan_t = plan_fixed(("t", "s"), (16, 256), STDIT, sp_size=4, method="ulysses", dim="t")
    assert plan_t.method_for("temporal") == "ulysses" and plan_t.method_for("spatial") == "local"
    with pytest.raises(ValueError, match="unknown dim"):
        plan_fixed(("t", "s"), (16, 256), STDIT, sp_size=4, method="ring", dim="h")


def test_non_periodic_plan_has_no_wraparound_switch() -> None:
    plan = plan_stages(("t", "s"), (8, 8), STDIT[:2], sp_size=2, periodic=False)
    assert plan.switches_per_period == 1

"""The one planner: brute force agrees with it, one and several activations share one policy,
and the method registry is what every part reads."""

from __future__ import annotations

import itertools
import random

import pytest

from dspzoo.core.costmodel import StageSpec, Workload, comm_bytes
from dspzoo.core.costmodel.cluster import get_cluster
from dspzoo.core.costmodel.formulas import flops_per_rank
from dspzoo.core.parallel.methods.registry import METHODS, OP_KINDS, get_method, methods_for
from dspzoo.core.parallel.multiplan import ActShape, MultiStage, plan_multi
from dspzoo.core.parallel.plan import Plan, PlanStep, Stage, plan_fixed, plan_stages
from dspzoo.core.parallel.planner import Policy, plan_problem, solve

NAMES = "abcd"
FIXED = ("ulysses", "ring", "ring_zigzag", "lss", "usp", "megatron_sp")


def _random_stage(rng: random.Random, name: str, dims: tuple[str, ...], act: str) -> MultiStage:
    mixes = tuple(d for d in dims if rng.random() < 0.4)
    op = "generic" if mixes and rng.random() < 0.3 else "attention"
    heads = rng.choice((None, 1, 2, 4, 8))
    return MultiStage(
        name,
        {act: mixes},
        op=op,
        heads=heads,
        embed_if_underfilled=op == "attention" and rng.random() < 0.2,
    )


def _brute_force(problem) -> float:
    return min(problem.cost(seq) for seq in itertools.product(*problem.options))


def test_one_activation_plans_equal_brute_force_on_random_stage_lists() -> None:
    rng = random.Random(0)
    checked = 0
    while checked < 2000:
        dims = tuple(NAMES[: rng.randint(1, 4)])
        lengths = tuple(rng.randint(1, 17) for _ in dims)
        n = rng.randint(2, 8)
        stages = [_random_stage(rng, f"s{i}", dims, "x") for i in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            policy = Policy()
        else:
            method = rng.choice(FIXED)
            policy = Policy("fixed", method, rng.choice(dims), get_method(method).layout)
        try:
            problem = plan_problem(
                {"x": ActShape(dims, lengths, rng.randint(1, 4))},
                stages,
                n,
                periodic=rng.random() < 0.7,
                policy=policy,
            )
        except ValueError:  # e.g. a stage whose op no allowed method runs over every dim
            continue
        got = problem.cost(solve(problem))
        assert got == pytest.approx(_brute_force(problem), rel=1e-9, abs=1e-9), (
            dims,
            lengths,
            n,
            stages,
            policy,
        )
        checked += 1


def test_two_activation_plans_equal_brute_force_on_random_stage_lists() -> None:
    rng = random.Random(1)
    checked = 0
    while checked < 500:
        da = tuple(NAMES[: rng.randint(1, 3)])
        db = tuple(f"{d}2" for d in NAMES[: rng.randint(1, 3)])
        shapes = {
            "m": ActShape(da, tuple(rng.randint(1, 17) for _ in da), rng.randint(1, 4)),
            "z": ActShape(db, tuple(rng.randint(1, 17) for _ in db), rng.randint(1, 4)),
        }
        stages = []
        for i in range(rng.randint(1, 3)):
            touched = rng.choice((("m",), ("z",), ("m", "z")))
            mixes = {
                a: tuple(d for d in shapes[a].dims if rng.random() < 0.35)[
                    : len(shapes[a].dims) - 1
                ]
                for a in touched
            }
            stages.append(MultiStage(f"s{i}", mixes))
        problem = plan_problem(
            shapes, stages, rng.randint(2, 8), periodic=rng.random() < 0.7, policy=Policy(hybrid=())
        )
        got = problem.cost(solve(problem))
        assert got == pytest.approx(_brute_force(problem), rel=1e-9, abs=1e-9)
        checked += 1


D3 = (Stage("mlp"), Stage("spatial", ("s",)))


def _d3_workload() -> Workload:
    layer = (
        StageSpec(D3[0], mlp=True, adaln=False),
        StageSpec(D3[1], attention=("s",), adaln=False),
    )
    return Workload("d3", "d3", 1, ("t", "s"), (1, 4096), 1152, 16, 16, 4608, (layer,), D3, 16,
                    16, itemsize=2)  # fmt: skip


def test_one_and_several_activations_agree_and_the_cost_model_prefers_the_answer() -> None:
    # the example (t = 1, s = 8) and the paper's scale (s = 4096 tokens, hidden 1152)
    for s_len in (8, 4096):
        single = plan_stages(("t", "s"), (1, s_len), D3, 2)
        multi = plan_multi(
            {"x": ActShape(("t", "s"), (1, s_len), 1)}, [s.as_multi() for s in D3], 2
        )
        assert [s.sharded for s in single.steps] == [
            multi.step_for(s.stage).dim("x") for s in single.steps
        ]
    # the alternative the planner rejected: t throughout (no switch, one rank idle all layer)
    idle = Plan(
        ("t", "s"),
        (1, 4096),
        2,
        True,
        tuple(PlanStep(s.name, s.mixes, "t") for s in D3),
    )
    assert single.switches_per_period == 2 and single.sharded_for("mlp") == "s"
    wl, cluster = _d3_workload(), get_cluster("h100-nvlink-ib")

    def predicted(plan: Plan) -> float:
        count = comm_bytes(wl, plan, 2, 0, exit_gather=False)
        comm = cluster.transfer_time(count.bytes(), 2, count.count())
        return flops_per_rank(wl, plan) / cluster.flops + comm

    assert predicted(single) <= predicted(idle)


def test_the_registry_is_complete_and_consistent() -> None:
    assert set(METHODS) >= {
        "local",
        "switch",
        "gather",
        "ulysses",
        "ring",
        "ring_zigzag",
        "lss",
        "usp",
        "megatron_sp",
    }
    assert {"attention", "generic"} <= set(OP_KINDS)
    for method in METHODS.values():
        for op in method.ops:
            assert op in OP_KINDS
        if method.entry:  # a method that communicates inside a stage says how much
            assert method.plan_cost(4, 8, 2) > 0 and method.formula
    # attention runs under every embedded method; a generic op only by getting it whole
    assert {m.name for m in methods_for("generic")} == {"gather"}
    assert {m.name for m in methods_for("attention", hybrid=True)} == {
        "ulysses",
        "ring",
        "ring_balanced",
    }
    assert get_method("ulysses").unsupported(4, heads=2) and not get_method("ring").unsupported(
        4, 2
    )
    with pytest.raises(ValueError, match="unknown method"):
        get_method("magic")
    with pytest.raises(ValueError, match="unknown op kind"):
        Stage("x", ("t",), op="magic")


def test_a_generic_stage_is_never_run_by_an_attention_method() -> None:
    stages = (Stage("attn", ("t",)), Stage("conv", ("t",), op="generic"), Stage("mlp"))
    for method in FIXED:
        layout = get_method(method).layout
        plan = plan_fixed(("t", "s"), (9, 5), stages, 3, "ring" if layout == "zigzag" else method,
                          "t", layout=layout)  # fmt: skip
        conv = plan.step_for("conv")
        assert conv.method in ("local", "gather"), (method, str(plan))
        assert conv.sharded != "t" or conv.method == "gather"

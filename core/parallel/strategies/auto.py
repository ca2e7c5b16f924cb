"""``strategy="auto"``: the candidate plan that sends least, priced from the method registry.

Candidates: DSP's plan (switches between stages; on a stage that mixes every dim the cheapest
of Ulysses, Ring, the balanced ring, LSS and the balanced LSS) and every fixed-dim plan of those
on each dim long enough to feed every rank. Cost of a plan, in switch units forward + backward:
2 per switch plus each stage's method cost (:meth:`Method.plan_cost`, under the stage's causal
mask or not; Ulysses is out where a stage has fewer heads than ranks). A causal stage is not
given a method whose causal work is unbalanced on the plan's layout (contiguous Ring and LSS:
the last rank does up to (2N−1)/N of the mean, :meth:`Method.causal_work_factor`) — the
balanced variants run it at about the same bytes. Ties keep the earlier candidate (DSP first).
Every remaining candidate has the same FLOPs on its busiest rank, so on any cluster the
cheapest here is the byte ranking of the cost model (latency terms aside).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..methods.registry import get_method
from ..plan import Plan, Stage, plan_fixed, plan_stages
from .base import Strategy

CANDIDATES = ("ulysses", "ring", "ring_balanced", "lss", "lss_balanced")


def stage_cost(method: str, stage: Stage, sp_size: int, layout: str) -> float:
    """Switch units of ``method`` running ``stage`` at ``sp_size`` on ``layout`` (module
    docstring): infinite for a causal stage whose causal work it would leave unbalanced."""
    m = get_method(method)
    if stage.causal and m.causal_work_factor(sp_size, layout) > 1.0:
        return math.inf
    return m.plan_cost(sp_size, stage.heads, causal=stage.causal)


def plan_units(plan: Plan, stages: tuple[Stage, ...]) -> float:
    """Forward + backward switch units of one period of ``plan``."""
    by_name = {s.name: s for s in stages}
    cost = 2.0 * plan.switches_per_period
    for step in plan.steps:
        if step.method != "local":
            cost += stage_cost(step.method, by_name[step.stage], plan.sp_size, plan.layout)
    return cost


def auto_plan(
    dims: tuple[str, ...], lengths: tuple[int, ...], stages: tuple[Stage, ...], sp_size: int
) -> Plan:
    """The plan ``strategy="auto"`` runs (module docstring)."""
    dims, lengths, stages = tuple(dims), tuple(lengths), tuple(stages)
    n = sp_size

    def cheapest(stage: Stage) -> str:
        # by cost; where no balanced method runs a causal stage (every cost infinite), the
        # fewest bytes among the unbalanced ones
        runnable = [m for m in CANDIDATES if get_method(m).runs(stage.op)]
        return min(
            runnable,
            key=lambda m: (
                stage_cost(m, stage, n, "contiguous"),
                get_method(m).plan_cost(n, stage.heads, causal=stage.causal),
            ),
        )

    forced = tuple(
        s
        if s.method is not None
        or any(d not in s.mixes for d in dims)
        or not any(get_method(m).runs(s.op) for m in CANDIDATES)
        else replace(s, method=cheapest(s))
        for s in stages
    )
    candidates = [plan_stages(dims, lengths, forced, n)]
    length_of = dict(zip(dims, lengths))
    for method in CANDIDATES:
        for dim in dims:
            if length_of[dim] < n and len(dims) > 1:
                continue
            candidates.append(plan_fixed(dims, lengths, stages, n, method, dim))
    best = min(candidates, key=lambda p: plan_units(p, stages))
    return Plan(
        dims=best.dims,
        lengths=best.lengths,
        sp_size=best.sp_size,
        periodic=best.periodic,
        steps=best.steps,
        strategy="auto",
        layout=best.layout,
    )


class Auto(Strategy):
    """Per stage, DSP's switch or an embedded method, whichever sends least."""

    name = "auto"

    def __init__(self, dim: str | None = None) -> None:
        if dim is not None:
            raise ValueError("the auto strategy chooses its sharded dims itself; do not pass dim")

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        return auto_plan(names, lengths, stages, sp_size)

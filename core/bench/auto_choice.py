"""The benchmark's ``auto`` column: which plan ``strategy="auto"`` picks for the case, its
measured step time, and that time over the best plan measured in the same run.

``auto`` is not a fixed method to compare (it is not in ``STRATEGIES``): it chooses one of the
plans the fixed strategies run. When a measured strategy runs exactly auto's plan (same steps —
sharded dim and method per stage — same layout), auto's measured time *is* that plan's: the
median of the repetitions of every row running it (pooled: rows running the same plan differ
only by the machine's noise), and it is compared with the best *plan* timed the same way.
When no row runs auto's plan, the benchmark adds an ``auto`` row
(:func:`needs_own_row`) and measures it like the others.
"""

from __future__ import annotations

import statistics
from typing import Any

from .case import PEER, Case
from .stats import paired_ratios, spread

AUTO = "auto"


def _signature(plan: Any) -> tuple:
    """What makes two plans run the same computation and communication."""
    return (plan.steps, plan.layout, plan.periodic)


def plan_of(case: Case, strategy: str, sp: int, dp: int) -> Any:
    """The plan the runtime makes for ``strategy`` on ``case`` (per DP group's batch); a
    Mamba case's scan methods resolve as the case runs them (:meth:`Case.strategy`)."""
    from ..costmodel import make_plan

    resolved = strategy if strategy == AUTO else case.strategy(strategy)
    return make_plan(case.workload(case.batch // dp), resolved, sp)


def twins(case: Case, names: list[str], sp: int, dp: int) -> list[str]:
    """The strategies of ``names`` whose plan is auto's (the DeepSpeed peer never: it runs
    DeepSpeed's own attention, not ours)."""
    if sp == 1:
        return []
    auto = _signature(plan_of(case, AUTO, sp, dp))
    return [
        n for n in names if n not in (PEER, AUTO) and _signature(plan_of(case, n, sp, dp)) == auto
    ]


def needs_own_row(case: Case, names: list[str], sp: int, dp: int) -> bool:
    """Whether auto's plan is none of the measured strategies' (then it is measured itself)."""
    return sp > 1 and not twins(case, names, sp, dp)


def _by_plan(case: Case, rows: list[dict[str, Any]], sp: int, dp: int) -> dict[tuple, list]:
    """The timed rows grouped by the plan they run (rows of one plan differ only by noise);
    auto's own row, when measured, is its plan's."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["strategy"] == PEER:  # DeepSpeed's attention, not one of our plans
            continue
        groups.setdefault(_signature(plan_of(case, r["strategy"], sp, dp)), []).append(r)
    return groups


def auto_choice(result: dict[str, Any], case: Case) -> dict[str, Any] | None:
    """Auto's plan, its measured time and its ratio to the best measured plan (``None`` at SP
    1 or without timed repetitions).

    Plans are compared with plans: each plan's time is the median of the pooled repetitions
    of every row running it, and per interleaved round the mean of those rows. (Comparing
    auto's pooled rows with the fastest single row — as the first version did — judged the
    plan of the fastest row 1.96× slower than itself when a twin row running the same plan had
    an unlucky run.)
    """
    rows = [r for r in result["rows"] if r["times"]]
    sp, dp = result["sp"], result["dp"]
    if sp == 1 or not rows:
        return None
    plans = _by_plan(case, rows, sp, dp)
    plan = plan_of(case, AUTO, sp, dp)
    mine = _signature(plan)
    if mine not in plans:
        return None

    def pooled(sig: tuple) -> float:
        return statistics.median(t for r in plans[sig] for t in r["times"])

    def per_round(sig: tuple) -> list[float]:
        return [statistics.mean(ts) for ts in zip(*(r["times"] for r in plans[sig]))]

    best = min(plans, key=pooled)
    measured, best_s = pooled(mine), pooled(best)
    return {
        "runs_as": [r["strategy"] for r in plans[mine]],
        "methods": sorted({s.method for s in plan.steps} - {"local"}) or ["local"],
        "switches_per_layer": plan.switches_per_period,
        "measured_s": measured,
        "best": ", ".join(r["strategy"] for r in plans[best]),
        "best_s": best_s,
        "vs_best": measured / best_s,
        "vs_best_paired": spread(paired_ratios(per_round(mine), per_round(best))),
    }


def auto_line(choice: dict[str, Any]) -> str:
    """One line of the report."""
    pair = choice["vs_best_paired"]
    runs = "its own row" if choice["runs_as"] == [AUTO] else "= " + ", ".join(choice["runs_as"])
    return (
        f"auto's choice: {'+'.join(choice['methods'])} with {choice['switches_per_layer']} "
        f"switch(es) per layer ({runs}); measured {choice['measured_s']:.3f} s; best measured "
        f"{choice['best']} {choice['best_s']:.3f} s; auto / best = {choice['vs_best']:.2f} "
        f"(paired per round: median {pair['median']:.2f}, IQR {pair['q1']:.2f}–{pair['q3']:.2f})"
    )

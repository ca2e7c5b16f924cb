"""The benchmark's ``auto`` column: which plan ``strategy="auto"`` picks for the case, its
measured step time, and that time over the best strategy measured in the same run.

``auto`` is not a fixed method to compare (it is not in ``STRATEGIES``): it chooses one of the
plans the fixed strategies run. When a measured strategy runs exactly auto's plan (same steps —
sharded dim and method per stage — same layout), auto's measured time *is* that plan's: the
median of the repetitions of every row running it (pooled: rows running the same plan differ
only by the machine's noise). When no row runs auto's plan, the benchmark adds an ``auto`` row
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


def auto_choice(result: dict[str, Any], case: Case) -> dict[str, Any] | None:
    """Auto's plan, its measured time and its ratio to the best measured row (``None`` at SP 1
    or without timed repetitions)."""
    rows = [r for r in result["rows"] if r["times"]]
    sp, dp = result["sp"], result["dp"]
    if sp == 1 or not rows:
        return None
    names = [r["strategy"] for r in rows]
    same = [AUTO] if AUTO in names else twins(case, names, sp, dp)
    mine = [r["times"] for r in rows if r["strategy"] in same]
    measured = statistics.median(t for times in mine for t in times)
    fixed = [r for r in rows if r["strategy"] != AUTO]
    best = min(fixed, key=lambda r: r["time"]["median"])
    # per interleaved round: auto's plan (the mean of its rows) over the best row's time
    rounds = [statistics.mean(ts) for ts in zip(*mine)]
    paired = spread(paired_ratios(rounds, best["times"]))
    plan = plan_of(case, AUTO, sp, dp)
    return {
        "runs_as": same,
        "methods": sorted({s.method for s in plan.steps} - {"local"}) or ["local"],
        "switches_per_layer": plan.switches_per_period,
        "measured_s": measured,
        "best": best["strategy"],
        "best_s": best["time"]["median"],
        "vs_best": measured / best["time"]["median"],
        "vs_best_paired": paired,
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

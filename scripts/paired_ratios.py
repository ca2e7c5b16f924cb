"""Paired step-time ratios of a ``dspzoo bench`` run against one strategy of the same run.

``dspzoo bench`` interleaves its strategies (one step of each per repetition, the order rotated)
and reports each one's ratio to ``dsp`` paired per repetition. This prints the same paired
ratio against any strategy of the run (``--against megatron_sp``: is LSS faster than
Megatron-SP?), from the ``results.json`` the run wrote: for every repetition ``i``,
``times[strategy][i] / times[against][i]`` (both measured in the same round, under the same
load), then the median and the range over repetitions. A ratio below 1 means faster than
``against``.

Usage::

    python scripts/paired_ratios.py outputs/bench/results.json --against megatron_sp
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def paired_ratios(rows: list[dict], against: str) -> dict[str, list[float]]:
    """Per-repetition ratios ``times[name][i] / times[against][i]`` for every row's strategy."""
    times = {row["strategy"]: row["times"] for row in rows if row.get("times")}
    if against not in times:
        raise SystemExit(
            f"--against {against!r} has no timed steps in this run; timed: {sorted(times)}"
        )
    base = times[against]
    return {name: [t / b for t, b in zip(runs, base)] for name, runs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a bench run's results.json")
    parser.add_argument("--against", default="megatron_sp", help="the strategy to divide by")
    args = parser.parse_args()
    result = json.loads(args.results.read_text())
    ratios = paired_ratios(result["rows"], args.against)
    print(f"{result['case']} — SP {result['sp']}, {result['reps']} repetitions")
    print(f"| strategy | step s (median) | ÷ {args.against} paired (median) | min–max | per rep |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        name = row["strategy"]
        if name not in ratios:
            continue
        r = ratios[name]
        print(
            f"| {name} | {statistics.median(row['times']):.3f} | {statistics.median(r):.2f} "
            f"| {min(r):.2f}–{max(r):.2f} | {', '.join(f'{x:.2f}' for x in r)} |"
        )


if __name__ == "__main__":
    main()

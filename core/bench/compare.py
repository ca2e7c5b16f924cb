"""Two benchmark runs side by side: each strategy's ratio to DSP before and after, and whether
it moved by more than its IQR.

    python -m dspzoo.core.bench.compare outputs/bench/before/results.json outputs/bench/after/results.json

The ratio is paired (``t_strategy[i] / t_dsp[i]`` within interleaved repetition ``i``), so it
is recomputed from the per-repetition times every ``results.json`` keeps, older runs included.
A ratio *moved* when its medians differ by more than the wider of the two runs' IQRs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .stats import moved_beyond_iqr, paired_ratios, spread


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{strategy: spread of its paired ratio to DSP}`` of one ``results.json``."""
    rows = {r["strategy"]: r for r in result["rows"]}
    dsp = rows["dsp"]["times"]
    return {name: spread(paired_ratios(r["times"], dsp)) for name, r in rows.items() if r["times"]}


def side_by_side(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A markdown table: per strategy, before and after (median ×dsp and IQR), moved?"""
    b, a = ratios(before), ratios(after)
    lines = [
        "| strategy | before ×dsp (median) | before IQR | after ×dsp (median) | after IQR | "
        "change | moved by more than the IQR |",
        "|---" * 7 + "|",
    ]
    for name in [n for n in b if n in a]:
        x, y = b[name], a[name]
        moved = "yes" if moved_beyond_iqr(x, y) else "no"
        if name == "dsp":
            moved = "– (the reference)"
        lines.append(
            f"| {name} | {x['median']:.2f} | {x['q1']:.2f}–{x['q3']:.2f} | {y['median']:.2f} | "
            f"{y['q1']:.2f}–{y['q3']:.2f} | {y['median'] - x['median']:+.2f} | {moved} |"
        )
    only = sorted(set(b) ^ set(a))
    if only:
        lines += ["", f"in one run only: {', '.join(only)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="results.json of the earlier run")
    parser.add_argument("after", help="results.json of the later run")
    args = parser.parse_args(argv)
    with open(args.before) as fh:
        before = json.load(fh)
    with open(args.after) as fh:
        after = json.load(fh)
    print(side_by_side(before, after))


if __name__ == "__main__":
    main()

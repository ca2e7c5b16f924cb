"""The benchmark's outputs: ``results.json``, ``results.md`` (the table) and ``results.png``."""

from __future__ import annotations

import json
import math
import os
from typing import Any

MiB = 2**20


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def markdown(result: dict[str, Any]) -> str:
    """The table: medians with spread, tokens/s, bytes (traced vs formula), memory, agreement,
    each as a ratio to DSP; then the skipped cases, the prediction error and the command."""
    lines = [
        f"## {result['case']}",
        "",
        f"mode `{result['mode']}`: {result['layout']}; {result['world']} processes, "
        f"{result['threads_per_process']} thread(s) each; warm-up {result['warmup']}, "
        f"{result['reps']} interleaved repetitions (step time = the slowest rank's). "
        "Bytes: sent per rank per step (forward + backward, worst rank), traced by the "
        "runtime's tracer beside the cost model's `comm_bytes`; memory: activations saved for "
        "backward per rank (worst rank), measured beside `activation_bytes`.",
        "",
        "| strategy | step s (median) | IQR | min–max | ×dsp | tokens/s | ×dsp | KiB/rank | "
        "formula KiB | = | ×dsp | act. MiB | formula | ×dsp | max abs diff vs dsp | "
        "predicted s | error |",
        "|---" * 17 + "|",
    ]
    for r in result["rows"]:
        t, v = r["time"], r["vs_dsp"]
        pred = r.get("prediction", {})
        ps = f"{pred['step_s']:.3f}" if "step_s" in pred else "–"
        pe = f"{pred['error']:+.0%}" if "step_s" in pred else "–"
        ratio_bytes = "–" if math.isnan(v["bytes"]) else f"{v['bytes']:.2f}"
        lines.append(
            f"| {r['strategy']} | {t['median']:.3f} | {t['q1']:.3f}–{t['q3']:.3f} | "
            f"{t['min']:.3f}–{t['max']:.3f} | {v['time']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{v['tokens_per_s']:.2f} | {_kib(r['bytes'])} | {_kib(r['formula_bytes'])} | "
            f"{'yes' if r['formula_exact'] else 'NO'} | {ratio_bytes} | "
            f"{r['activation_bytes'] / MiB:.2f} | {r['formula_activation_bytes'] / MiB:.2f} | "
            f"{v['activation']:.2f} | {r['max_abs_diff']:.1e} | {ps} | {pe} |"
        )
    if result.get("baseline_sp1"):
        base = result["baseline_sp1"]["median"]
        lines += ["", f"strong scaling: one process alone (SP 1) {base:.3f} s; speed-up "]
        lines[-1] += ", ".join(
            f"{r['strategy']} {base / r['time']['median']:.2f}× "
            f"(efficiency {base / r['time']['median'] / result['world']:.0%})"
            for r in result["rows"]
        )
    if result["skipped"]:
        lines += ["", "not run:"]
        lines += [f"- {k}: {why}" for k, why in result["skipped"].items()]
    if "prediction_error" in result:
        e, cl = result["prediction_error"], result["cluster"]
        lines += [
            "",
            f"cost model on `{cl['name']}` ({cl['peak_tflops'] * 1e3:.1f} GFLOP/s per process, "
            f"{cl['intra_bw'] / 1e6:.0f} MB/s, {cl['intra_lat'] * 1e3:.1f} ms per collective): "
            f"step-time prediction error median {e['median_abs']:.0%}, max {e['max_abs']:.0%}",
        ]
    lines += ["", f"reproduce: `{result['command']}`", ""]
    return "\n".join(lines)


def chart(result: dict[str, Any], path: str) -> None:
    """Step time (median, IQR bars), bytes per rank and activation memory, as ratios to DSP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(min(6 + 1.2 * len(rows), 18), 4.5))
    dsp = rows[0]["time"]["median"]
    med = [r["time"]["median"] / dsp for r in rows]
    lo = [m - r["time"]["q1"] / dsp for m, r in zip(med, rows)]
    hi = [r["time"]["q3"] / dsp - m for m, r in zip(med, rows)]
    axes[0].bar(x, med, yerr=[lo, hi], capsize=3, color="#4c72b0")
    axes[0].set_title("step time ×dsp (median, IQR)")
    axes[1].bar(x, [r["vs_dsp"]["bytes"] for r in rows], color="#dd8452")
    axes[1].set_title("bytes sent per rank ×dsp")
    axes[2].bar(x, [r["vs_dsp"]["activation"] for r in rows], color="#55a868")
    axes[2].set_title("activation memory per rank ×dsp")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=35, ha="right")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    fig.suptitle(f"{result['case']} — {result['layout']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], out: str) -> dict[str, str]:
    """Write the three files into ``out``, print the table; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f"results.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    text = markdown(result)
    with open(paths["md"], "w") as fh:
        fh.write(text)
    chart(result, paths["png"])
    print("\n" + text)
    print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}", flush=True)
    return paths

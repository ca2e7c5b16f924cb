"""The benchmark's outputs: ``results.json``, ``results.md`` (the table) and ``results.png``."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .precision import DTYPE_SHORT_NAMES, MAX_RTOL, ROUNDING_MARGIN, ROUNDINGS

MiB = 2**20


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def time_table(result: dict[str, Any]) -> list[str]:
    """Step times (median, IQR, range) and the ratio to DSP: of the medians, and paired per
    interleaved repetition (median and IQR of ``t_strategy[i] / t_dsp[i]``)."""
    lines = [
        "| strategy | step s (median) | IQR | min–max | ×dsp | ×dsp paired (median) | "
        "paired IQR | tokens/s | predicted s | error |",
        "|---" * 10 + "|",
    ]
    auto = set(result.get("auto", {}).get("runs_as", ()))
    for r in result["rows"]:
        t, v = r["time"], r["vs_dsp"]
        name = f"{r['strategy']} (auto's plan)" if r["strategy"] in auto else r["strategy"]
        pair = v["time_paired"]
        pred = r.get("prediction", {})
        ps = f"{pred['step_s']:.3f}" if "step_s" in pred else "–"
        pe = f"{pred['error']:+.0%}" if "step_s" in pred else "–"
        lines.append(
            f"| {name} | {t['median']:.3f} | {t['q1']:.3f}–{t['q3']:.3f} | "
            f"{t['min']:.3f}–{t['max']:.3f} | {v['time']:.2f} | {pair['median']:.2f} | "
            f"{pair['q1']:.2f}–{pair['q3']:.2f} | {r['tokens_per_s']:,.0f} | {ps} | {pe} |"
        )
    return lines


def autocast(result: dict[str, Any]) -> bool:
    """Whether the run's steps ran under autocast (``--mixed-precision`` bf16 or fp16)."""
    return result.get("precision", "no") != "no"


def _verdict(row: dict[str, Any]) -> str:
    """The check's word for a row: ``ok``, ``DIFFERS``, or ``NON-FINITE`` (an inf/NaN loss or
    gradient, in the strategy's step or the one-process reference's: under fp16 an overflow
    that the loss scale did not avoid)."""
    if not row.get("finite_grads", True):
        return "NON-FINITE"
    return "ok" if row["agrees"] else "DIFFERS"


def sent_as(by_dtype: dict[str, int]) -> str:
    """The floating-point dtypes a rank's collectives carried, as shares of its bytes
    (``bf16 33%, fp32 67%``); integer control payloads (the input check's flag) left out."""
    floats = {DTYPE_SHORT_NAMES[k]: v for k, v in by_dtype.items() if k in DTYPE_SHORT_NAMES}
    total = sum(floats.values())
    if not total:
        return "–"
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(floats.items()))


def _worst_rank_dtypes(row: dict[str, Any]) -> dict[str, int]:
    """The dtype split of the rank that sent the most bytes."""
    per = row.get("bytes_by_dtype") or [{}]
    return max(per, key=lambda d: sum(d.values()))


def _exact(row: dict[str, Any], mixed: bool) -> str:
    """The '=' cell: ``yes`` (fp32: traced bytes = formula); under autocast ``bytes`` (= the
    formula byte for byte, each collective in its dtype), ``elements`` (only the elements
    agree: the formula prices some collective in another dtype than it sent), else ``NO``."""
    if not row["formula_exact"]:
        return "NO"
    if not mixed:
        return "yes"
    return "bytes" if row.get("formula_bytes_exact") else "elements"


def bytes_table(result: dict[str, Any]) -> list[str]:
    """Per strategy: its methods, bytes traced beside the formula, memory, the check.

    Under autocast the formula in brackets is at the run's element size (``itemsize``), '='
    compares the elements sent (16-bit payloads at fp32 size) with the formula at 4 bytes,
    and a column says which dtypes the bytes went as."""
    checked = result.get("checked", False)
    mixed = autocast(result)
    on_device = any(r.get("peak_device_bytes") for r in result["rows"])
    formula = (
        f"formula at {result['itemsize']} B/elem, stream {result.get('stream_itemsize', 4)}"
        if mixed
        else "formula"
    )
    head = (
        f"| strategy | methods | fwd KiB/rank ({formula}) | bwd KiB/rank ({formula}) | "
        f"{'= bytes/elements' if mixed else '='} | ×dsp |"
        f"{' sent as |' if mixed else ''} act. MiB | formula | ×dsp | traced step s | "
        "peak RSS MiB |"
    )
    if on_device:  # the CUDA allocator's peak in the traced step, above what was allocated before
        head += " peak GPU MiB (step) |"
    if checked:
        head += " output err | grad err | vs 1 process |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in result["rows"]:
        v = r["vs_dsp"]
        line = (
            f"| {r['strategy']} | {'+'.join(r['methods'])} | "
            f"{_kib(r['bytes_fwd'])} ({_kib(r['formula_bytes_fwd'])}) | "
            f"{_kib(r['bytes_bwd'])} ({_kib(r['formula_bytes_bwd'])}) | "
            f"{_exact(r, mixed)} | {_num(v['bytes'], '.2f')} | "
            f"{sent_as(_worst_rank_dtypes(r)) + ' | ' if mixed else ''}"
            f"{r['activation_bytes'] / MiB:.2f} | {r['formula_activation_bytes'] / MiB:.2f} | "
            f"{v['activation']:.2f} | {r['traced_step_s']:.3f} | {r['peak_rss_bytes'] / MiB:,.0f} |"
        )
        if on_device:
            line += f" {(r.get('peak_device_bytes') or 0) / MiB:,.0f} |"
        if checked:
            line += f" {r['output_error']:.1e} | {r['grad_error']:.1e} | {_verdict(r)} |"
        lines.append(line)
    return lines


def precision_note(result: dict[str, Any]) -> str:
    """What a mixed-precision run means for its figures (the paragraph under the title)."""
    size = result["itemsize"]
    return (
        f"Precision: {result['precision_label']}: every step's forward and loss (and the "
        f"one-process reference's) under `torch.autocast`, the backward in the dtypes it chose. "
        f"Bytes: what was sent, some collectives in {result['precision']}, others in fp32 "
        f"(sent as: the worst rank's split). The formula prices what the linears and attention "
        f"produce at {size} bytes per element and the residual stream (DSP's switches, "
        f"Megatron-SP's all-gather of a norm's output) at 4, as the cost model does for this "
        f"precision (ring's softmax statistics and dK/dV at 4 too). '= bytes/elements', on "
        f"every rank for every op and phase: 'bytes' where the bytes sent equal the formula's, "
        f"'elements' where only the elements do (16-bit payloads counted at fp32 size against "
        f"the formula at 4 bytes: some collective went in another dtype than the formula "
        f"prices). The activation-memory formula counts every saved tensor at {size} bytes; "
        f"autocast keeps the stream's and the norms' saved inputs in fp32 (and bf16 copies of "
        f"the weights, which the meter counts), so it reads low. The check's tolerance follows "
        f"the dtype."
    )


def markdown(result: dict[str, Any]) -> str:
    """The tables (time; bytes, memory and the check), the skipped cases, the prediction error
    and the command."""
    reps = result["reps"]
    timing = (
        f"warm-up {result['warmup']}, {reps} interleaved repetitions (step time = the slowest "
        "rank's; ×dsp paired: the ratio taken within each repetition, its median and IQR)"
        if reps
        else "the traced step only (--reps 0: no timed repetitions)"
    )
    rows = result["rows"]
    scale = min((r.get("loss_scale", 1.0) for r in rows), default=1.0)
    reference_scale = min((r.get("reference_loss_scale", scale) for r in rows), default=scale)
    check = (
        f"the gathered output and every parameter gradient against one process on the same "
        f"samples (relative error, flagged above "
        f"{result['rtol']:{'.1e' if autocast(result) else '.0e'}}"
        + (
            f": the larger of {ROUNDINGS} × the dtype's epsilon and {ROUNDING_MARGIN} × the "
            f"one-process step's own "
            f"rounding, {max(r.get('reference_rounding', 0.0) for r in rows):.1e} "
            f"from the same step in fp32, at most {MAX_RTOL}"
            + (
                f"; the loss scaled by 2^{round(math.log2(reference_scale))} in the one-process "
                f"reference, 2^{round(math.log2(scale))} in the SP steps"
                if reference_scale != 1
                else ""
            )
            + ")"
            if autocast(result)
            else ")"
        )
        if result.get("checked")
        else "no check against one process (--no-check)"
    )
    lines = [
        f"## {result['case']}" + (f" — {result['precision']} autocast" if autocast(result) else ""),
        "",
        f"mode `{result['mode']}`: {result['layout']}; {result['world']} processes "
        f"on {result.get('device', 'cpu')}, "
        f"{result['threads_per_process']} thread(s) each, {result.get('meshes', '?')} "
        f"mesh(es) in all, one per SP layout, shared by the strategies; {timing}. Bytes: sent per rank per step, worst "
        "rank, traced by the runtime's tracer beside the cost model's `comm_bytes` walking the "
        "same plan ('=': equal on every rank for every op and phase); memory: activations saved "
        f"for backward per rank (worst rank) beside `activation_bytes`; check: {check}.",
        "",
    ]
    if autocast(result):
        lines[-2] += " " + precision_note(result)
    if reps:
        lines += [*time_table(result), ""]
    lines += bytes_table(result)
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
    if "auto" in result:
        from .auto_choice import auto_line

        lines += ["", auto_line(result["auto"])]
    if "prediction_skipped" in result:
        lines += ["", result["prediction_skipped"]]
    if "prediction_error" in result:
        e, cl = result["prediction_error"], result["cluster"]
        lines += [
            "",
            f"cost model on `{cl['name']}` ({cl['peak_tflops'] * 1e3:.1f} GFLOP/s per process, "
            f"{cl['intra_bw'] / 1e6:.0f} MB/s, {cl['intra_lat'] * 1e3:.2f} ms per collective"
            f"{'; probed in this run' if 'probe' in result and cl['name'] == 'this-cpu' else ''}): "
            f"step-time prediction error median {e['median_abs']:.0%}, max {e['max_abs']:.0%}",
        ]
        if "median_abs_without_probed_terms" in e:
            terms = []
            if cl.get("hbm_bw"):
                terms.append(f"memory-bound terms at {cl['hbm_bw'] / 1e9:.1f} GB/s")
            if cl.get("attention_tflops"):
                terms.append(f"attention at {cl['attention_tflops'] * 1e3:.1f} GFLOP/s")
            if cl.get("switch_bw"):
                terms.append(
                    f"switches at {cl['switch_bw'] / 1e6:.0f} MB/s, "
                    f"{cl['switch_lat'] * 1e3:.2f} ms per call"
                )
            lines[-1] += (
                f" ({', '.join(terms)}; without them: median "
                f"{e['median_abs_without_probed_terms']:.0%}, max {e['max_abs_without_probed_terms']:.0%})"
            )
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
    kinds = ("json", "md", "png") if result["reps"] else ("json", "md")  # png: the timings
    paths = {k: os.path.join(out, f"results.{k}") for k in kinds}
    with open(paths["json"], "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    text = markdown(result)
    with open(paths["md"], "w") as fh:
        fh.write(text)
    if "png" in paths:
        chart(result, paths["png"])
    print("\n" + text)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths

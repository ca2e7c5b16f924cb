"""CPU benchmark of one scan stage under the three scan methods at SP 2 (gloo).

The same Mamba mixer, weights and input ``[B, T, S, C]``, one stage that scans ``s``:

* ``dsp``: the DSP plan shards ``t``; each rank scans its ``T/N`` lines of ``S`` whole, with no
  communication inside the stage (the axial case);
* ``state_passing``: ``s`` sharded; each rank scans its segment of every line, the conv halo by
  p2p, the segment summaries in one all-gather, a correction;
* ``head_a2a``: ``s`` sharded; an all-to-all to head (channel) shards after the conv, whole
  lines per head, and back.

Every rank does the same FLOPs up to the methods' extras. Per step (forward + backward of the
stage, entry split and exit gather included, as in a model): the median wall time over
interleaved rounds (every method once per round), its ratio to ``dsp``, the bytes this rank
sent (traced, exit gather excluded) and the activation memory saved for backward
(:class:`~dspzoo.core.parallel.trace.SavedTensorMeter`)::

    python scripts/bench_scan_methods.py                          # Mamba-2, S = 4096
    python scripts/bench_scan_methods.py --mixer mamba1 --length 2048 --rounds 5

Times on a shared CPU are noisy; the ratios within one run are what to read.

**The crossover sweep** (``--model``, a zoo Mamba LM): the whole LM, one training step
(forward, the sharded loss, backward) under each method at every length of ``--lengths``, in
one spawn of ``--world`` ranks. Per length: the median step over interleaved rounds (worst
rank), its CPU time (worst rank: the work, whatever the shared machine queues), the bytes this
rank sent inside the model (traced) beside the cost model's ``comm_bytes`` on the plan the
runtime makes (``=``: equal on every rank), and the activation memory. State passing sends a
fixed ``(N−1)·(decay + state)`` per layer, the head all-to-all ``~L·C·(N−1)/N`` per layer: the
formula's crossover, printed, is where the two byte counts meet; ``--json`` keeps the rows for
``--plot`` (bytes and step time against ``L``, one panel per quantity, SP sizes together)::

    python scripts/bench_scan_methods.py --model mamba2lm-small --world 2 \
        --lengths 32 64 128 256 1024 4096 --json sp2.json
    python scripts/bench_scan_methods.py --plot docs/images/scan_methods_crossover.png sp2.json sp4.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dspzoo.core.layers.mamba import (
    Mamba1Config,
    Mamba1Mixer,
    Mamba2Config,
    Mamba2Mixer,
    scan_along,
)
from dspzoo.core.parallel import context
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.plan import Stage
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.strategies import Embedded
from dspzoo.core.parallel.trace import SavedTensorMeter, format_bytes, trace_comm
from dspzoo.core.testing import run_distributed

METHODS = ("dsp", "state_passing", "head_a2a")
NAMES = ("t", "s")
STAGES = (Stage("scan", ("s",), op="scan"),)


def make_mixer(kind: str, hidden: int) -> nn.Module:
    """Mamba-1 (state 16) or Mamba-2 (heads of 64, state 64, one group, chunk 256)."""
    if kind == "mamba1":
        return Mamba1Mixer(Mamba1Config(hidden_size=hidden, state_size=16))
    inner = 2 * hidden
    return Mamba2Mixer(
        Mamba2Config(
            hidden_size=hidden, num_heads=inner // 64, head_dim=64, state_size=64, chunk_size=256
        )
    )


class ScanStage(nn.Module):
    """One residual scan stage over ``s`` of a ``[B, T, S, C]`` activation."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.mixer = make_mixer(kind, hidden)

    def forward(self, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
        act = sp.enter(x, NAMES, STAGES)
        with sp.region(act) as region:
            h = context.stage("scan", act.tensor)
            act = region.seq(h + scan_along(self.mixer, h, "s"))
        return sp.exit(act)


def runtime(mesh: SPMesh, method: str, dim: str | None = "s") -> SeqParallel:
    """DSP's plan, or ``dim`` (``None``: the longest) sharded with the scan method."""
    return SeqParallel(mesh, "dsp" if method == "dsp" else Embedded(method, dim))


def _step(model: nn.Module, x: torch.Tensor, sp: SeqParallel, group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    out = model(x, sp)
    out.square().mean().backward()
    dist.barrier(group=group)
    return time.perf_counter() - start


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    mesh = SPMesh(world, rank, 1, world, 0, rank, sp_group=dist.group.WORLD)
    torch.manual_seed(0)
    model = ScanStage(args.mixer, args.hidden)
    x = torch.randn(args.batch, args.lines, args.length, args.hidden)
    sps = {m: runtime(mesh, m) for m in METHODS}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    sent, saved = {}, {}
    for m in METHODS:  # warm-up, bytes and memory (one step each)
        with trace_comm() as tracer, SavedTensorMeter(exclude=model.parameters()) as meter:
            out = model(x, sps[m])
        out.square().mean().backward()
        sent[m] = sum(r.bytes_sent for r in tracer.records if not r.region.startswith("exit"))
        saved[m] = meter.bytes
        model.zero_grad(set_to_none=True)
    for _ in range(args.rounds):
        for m in METHODS:
            times[m].append(_step(model, x, sps[m], dist.group.WORLD))
            model.zero_grad(set_to_none=True)
    return {"times": times, "sent": sent, "saved": saved}


# -- the LM crossover sweep ---------------------------------------------------------------------
MODEL_OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p")  # as core/bench


def method_plan(workload, method: str, world: int):
    """The plan the runtime makes for ``method``: DSP's own, or the scan method embedded."""
    from dspzoo.core.costmodel import make_plan

    if method == "dsp":
        return make_plan(workload, "dsp", world)
    return Embedded(method).plan(workload.dims, workload.lengths, workload.period, world)


def formula_crossover(model: str, world: int, batch: int = 1, limit: int = 1 << 20) -> int:
    """Smallest ``L`` (a bisection over lengths ≥ 2N) where the cost model's state-passing bytes
    per rank are below the head all-to-all's (worst rank, forward + backward)."""
    from dspzoo.core.costmodel import comm_bytes
    from dspzoo.zoo.workloads import workload_for

    def cheaper(length: int) -> bool:
        wl = workload_for(model, batch=batch, seq_len=length)
        worst = {
            m: max(
                comm_bytes(wl, method_plan(wl, m, world), world, r, exit_gather=False).bytes()
                for r in range(world)
            )
            for m in ("state_passing", "head_a2a")
        }
        return worst["state_passing"] < worst["head_a2a"]

    lo, hi = 2 * world, limit
    if cheaper(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cheaper(mid) else (mid, hi)
    return hi


def _lm_step(model: nn.Module, tokens: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    from dspzoo.domains.text.model import lm_loss

    return lm_loss(model(tokens[:, :-1], sp, gather_output=False), tokens[:, 1:], sp)


def _timed_lm_step(model: nn.Module, tokens: torch.Tensor, sp: SeqParallel) -> tuple[float, float]:
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    _lm_step(model, tokens, sp).backward()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - wall, cpu


def _lm_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import dspzoo.domains.mamba  # noqa: F401  (registers the Mamba families)
    from dspzoo.core.costmodel import comm_bytes
    from dspzoo.zoo import create_model
    from dspzoo.zoo.workloads import workload_for

    torch.set_num_threads(args.threads)
    mesh = SPMesh(world, rank, 1, world, 0, rank, sp_group=dist.group.WORLD)
    torch.manual_seed(0)
    model = create_model(args.model)
    sps = {m: runtime(mesh, m, None) for m in METHODS}
    rows = []
    for length in args.lengths:
        g = torch.Generator().manual_seed(length)
        tokens = torch.randint(0, 256, (args.batch, length + 1), generator=g)
        wl = workload_for(args.model, batch=args.batch, seq_len=length)
        row: dict = {"length": length, "methods": {}}
        for m in METHODS:  # warm-up: traced bytes, formula, memory
            counts = comm_bytes(wl, method_plan(wl, m, world), world, rank, exit_gather=False)
            with trace_comm() as tracer:
                with SavedTensorMeter(exclude=model.parameters()) as meter:
                    loss = _lm_step(model, tokens, sps[m])
                loss.backward()
            model.zero_grad(set_to_none=True)
            traced: dict[str, int] = {}
            for r in tracer.records:
                if r.op in MODEL_OPS and r.bytes_sent:
                    key = f"{r.op}/{r.phase}"
                    traced[key] = traced.get(key, 0) + r.bytes_sent
            formula = {f"{op}/{ph}": b for (op, ph), (_, b) in counts.items() if b}
            row["methods"][m] = {
                "traced": sum(traced.values()),
                "formula": counts.bytes(),
                "exact": traced == formula,
                "activation": meter.bytes,
                "times": [],
                "cpu": [],
            }
        for _ in range(args.rounds):
            for m in METHODS:
                wall, cpu = _timed_lm_step(model, tokens, sps[m])
                row["methods"][m]["times"].append(wall)
                row["methods"][m]["cpu"].append(cpu)
                model.zero_grad(set_to_none=True)
        rows.append(row)
    return rows


def _merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Worst rank per quantity; a round's step is its slowest rank's."""
    merged = []
    for rows in zip(*per_rank):
        out = {"length": rows[0]["length"], "methods": {}}
        for m in METHODS:
            r = [row["methods"][m] for row in rows]
            rounds = len(r[0]["times"])
            out["methods"][m] = {
                "step_s": statistics.median(max(x["times"][i] for x in r) for i in range(rounds)),
                "cpu_s": statistics.median(max(x["cpu"][i] for x in r) for i in range(rounds)),
                "traced": max(x["traced"] for x in r),
                "formula": max(x["formula"] for x in r),
                "exact": all(x["exact"] for x in r),
                "activation": max(x["activation"] for x in r),
            }
        merged.append(out)
    return merged


def run_sweep(args: argparse.Namespace, command: str) -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    per_rank = run_distributed(_lm_worker, args.world, args, timeout=3600)
    rows = _merge_ranks(per_rank)
    crossover = formula_crossover(args.model, args.world, args.batch)
    load_after = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {command}")
    print(
        f"# {args.model}, batch {args.batch}, SP {args.world}, {args.rounds} interleaved rounds, "
        f"torch {torch.__version__}, {args.threads} thread(s)/rank, load average {load} before, "
        f"{load_after} after"
    )
    print(
        f"# formula crossover: state passing sends fewer bytes than head_a2a from L = {crossover}"
    )
    print(
        "| L | method | step s | CPU s | CPU / head_a2a | traced KiB/rank | formula | = "
        "| act. MiB/rank |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for row in rows:
        a2a = row["methods"]["head_a2a"]["cpu_s"]
        for m, r in row["methods"].items():
            print(
                f"| {row['length']} | {m} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | "
                f"{r['cpu_s'] / a2a:.2f} | {r['traced'] / 1024:.1f} | {r['formula'] / 1024:.1f} | "
                f"{'yes' if r['exact'] else 'NO'} | {r['activation'] / 2**20:.2f} |"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "model": args.model,
                    "world": args.world,
                    "batch": args.batch,
                    "rounds": args.rounds,
                    "load_average": [load, load_after],
                    "formula_crossover": crossover,
                    "rows": rows,
                },
                indent=1,
            )
        )


def plot(out: str, sources: list[str]) -> None:
    """Bytes per rank (traced points, formula lines) and step CPU time against ``L``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(s).read_text()) for s in sources]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"state_passing": "tab:blue", "head_a2a": "tab:orange", "dsp": "tab:green"}
    styles = {2: "-", 4: "--", 3: ":", 8: "-."}
    for run in runs:
        n, rows = run["world"], run["rows"]
        lengths = [r["length"] for r in rows]
        for m in ("state_passing", "head_a2a"):
            c, ls = colours[m], styles.get(n, "-")
            ax_b.plot(lengths, [r["methods"][m]["formula"] / 1024 for r in rows], ls, color=c,
                      label=f"{m}, SP {n} (formula)")  # fmt: skip
            ax_b.plot(lengths, [r["methods"][m]["traced"] / 1024 for r in rows], "o", color=c,
                      mfc="none")  # fmt: skip
            ax_t.plot(lengths, [r["methods"][m]["cpu_s"] for r in rows], ls + "o", color=c,
                      label=f"{m}, SP {n}")  # fmt: skip
        ax_b.axvline(run["formula_crossover"], color="grey", ls=styles.get(n, "-"), lw=0.8)
    for ax in (ax_b, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_b.set_ylabel("KiB sent per rank per step (worst rank)")
    ax_b.set_title("bytes: formula (lines), traced (circles);\ngrey: formula crossover")
    ax_t.set_ylabel("CPU s per training step (worst rank)")
    ax_t.set_title("step time")
    ax_b.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"{runs[0]['model']}: state passing vs head all-to-all")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--mixer", choices=("mamba1", "mamba2"), default="mamba2")
    parser.add_argument("--length", type=int, default=4096, help="S, the scanned dim")
    parser.add_argument("--lines", type=int, default=2, help="T, the other dim")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2, help="SP size (gloo processes)")
    parser.add_argument("--model", help="a zoo Mamba LM: the crossover sweep over --lengths")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--json", help="sweep: write the rows here (for --plot)")
    parser.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"),
                        help="draw PNG from sweep JSON files (runs nothing)")  # fmt: skip
    args = parser.parse_args(argv)
    command = "python scripts/bench_scan_methods.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    if args.plot:
        plot(args.plot[0], args.plot[1:])
        return
    if args.model:
        run_sweep(args, command)
        return
    results = run_distributed(_worker, args.world, args, timeout=3600)
    print(f"# {command}")
    print(
        f"# {args.mixer} hidden {args.hidden}, x [B={args.batch}, T={args.lines}, "
        f"S={args.length}, C={args.hidden}], scan over s, SP {args.world}, "
        f"{args.rounds} interleaved rounds, torch {torch.__version__}, {args.threads} thread(s)/rank"
    )
    base = None
    print(f"{'method':<14} {'step ms':>9} {'/ dsp':>7} {'sent/rank':>11} {'saved/rank':>11}")
    for m in METHODS:
        per_round = [max(r["times"][m][i] for r in results) for i in range(args.rounds)]
        median = statistics.median(per_round)
        base = median if base is None else base
        sent = max(r["sent"][m] for r in results)
        saved = max(r["saved"][m] for r in results)
        print(
            f"{m:<14} {median * 1e3:>9.1f} {median / base:>7.2f} {format_bytes(sent):>11} "
            f"{format_bytes(saved):>11}"
        )


if __name__ == "__main__":
    main()

r"""Where one training step's CPU time goes, strategy by strategy (the benchmark's case).

    OMP_NUM_THREADS=1 nice -n 15 accelerate launch --multi_gpu --num_processes 2 \
        --num_machines 1 --mixed_precision no --dynamo_backend no scripts/profile_step.py \
        --model bytelm-small --seq-len 8192 --strategies megatron_sp,ring_zigzag --out DIR

Builds the benchmark's model, inputs and strategies (:mod:`dspzoo.core.bench`), runs one
warm-up step per strategy, then ``--steps`` forward + backward steps per strategy
(interleaved) under :mod:`torch.profiler` (CPU activities). Per rank it writes
``DIR/<strategy>.rank<r>.txt``: the operators sorted by self CPU time, and the step's
thread CPU time and wall time split into forward and backward. Rank 0 prints a summary:
per strategy and rank, the step's CPU and wall seconds and the self CPU seconds of the
operator categories of :data:`CATEGORIES` (attention kernels, matmuls, communication waits,
copies, elementwise work), so two strategies can be compared category by category. Thread
CPU time counts what this process computed, not the time it waited on the other ranks or on
other processes of a loaded machine. The operator times are the profiler's (wall time inside
each operator, a blocking collective's wait included).

``--reps R`` then times ``R`` more steps per strategy without the profiler, interleaved (the
order rotated per repetition), and prints per strategy the median step wall time (slowest
rank) and busiest rank's CPU time, each with its ratio to ``--against`` in the same
repetition: the CPU ratio is what the step would cost with a core per rank, the wall ratio
what it cost on this machine as loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# operator-name fragments → category (first match wins; the rest is "other")
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash_attention", "scaled_dot_product")),
    ("matmul", ("mm", "matmul", "linear", "bmm", "addmm", "einsum", "baddbmm")),
    ("comm wait", ("wait", "gloo", "batch_isend_irecv", "all_gather", "reduce_scatter", "c10d")),
    ("copy", ("copy_", "contiguous", "clone", "cat", "index_select", "pad", "to", "_to_copy")),
    ("alloc", ("empty", "zeros", "zero_", "full", "fill_")),
)


def category(name: str) -> str:
    """The :data:`CATEGORIES` entry an operator name falls in (``"other"``: elementwise etc.)."""
    low = name.lower()
    for cat, parts in CATEGORIES:
        if any(p in low for p in parts):
            return cat
    return "other"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        epilog="Any other flag of the benchmark's case (--frames, --latent, ...) is passed on.",
    )
    p.add_argument("--model", default="bytelm-small")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--strategies", default="megatron_sp,ring,ring_zigzag,lss_zigzag")
    p.add_argument("--steps", type=int, default=1, help="profiled steps per strategy")
    p.add_argument("--rows", type=int, default=25, help="operators listed per file")
    p.add_argument(
        "--reps",
        type=int,
        default=0,
        help="then timed steps per strategy, interleaved (no profiler)",
    )
    p.add_argument("--against", default="megatron_sp", help="the --reps ratios' denominator")
    p.add_argument("--out", default="outputs/profile")
    p.add_argument("--seed", type=int, default=0)
    return p


def _step(runner: Any) -> dict[str, float]:
    """One forward + backward; wall and thread CPU seconds of each."""
    runner.model.zero_grad(set_to_none=True)
    dist.barrier()
    w0, c0 = time.perf_counter(), time.thread_time()
    loss, _ = runner.case.step(runner.model, runner.sp, runner.inputs)
    w1, c1 = time.perf_counter(), time.thread_time()
    loss.backward()
    w2, c2 = time.perf_counter(), time.thread_time()
    return {"fwd_wall": w1 - w0, "fwd_cpu": c1 - c0, "bwd_wall": w2 - w1, "bwd_cpu": c2 - c1}


def main(argv: list[str] | None = None) -> None:
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.meshes import MeshCache
    from dspzoo.core.bench.runner import Runner
    from dspzoo.core.bench.runner import build_parser as build_bench_parser

    args, case_flags = build_parser().parse_known_args(argv)
    # the case as the benchmark builds it: its defaults, and any of its flags given here
    # (--frames, --latent, --full-attention-every, ...)
    bench_args = build_bench_parser().parse_args(
        ["--model", args.model, "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
        + case_flags
    )
    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    torch.set_num_threads(1)
    world, rank = world_mesh.world_size, world_mesh.rank
    case = build_case(bench_args, args.batch)
    meshes = MeshCache(accelerator, built=(world_mesh,))
    names = [s.strip() for s in args.strategies.split(",")]
    runners = [Runner(n, case, world, meshes) for n in names]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in runners:  # warm-up
        _step(r)
    summary: dict[str, Any] = {}
    for r in runners:
        acts = [torch.profiler.ProfilerActivity.CPU]
        times = []
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                times.append(_step(r))
        avg = prof.key_averages()
        cats: dict[str, float] = {}
        for e in avg:
            cats[category(e.key)] = cats.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e6
        step = {k: sum(t[k] for t in times) / args.steps for k in times[0]}
        cats = {k: v / args.steps for k, v in sorted(cats.items())}
        table = avg.table(sort_by="self_cpu_time_total", row_limit=args.rows)
        (out / f"{r.name}.rank{rank}.txt").write_text(
            f"{r.name} rank {rank}: {json.dumps(step)}\ncategories (self CPU s per step): "
            f"{json.dumps(cats)}\n{table}\n"
        )
        summary[r.name] = {"step": step, "categories": cats}
    for i in range(args.reps):  # interleaved, order rotated per repetition
        for r in runners[i % len(runners) :] + runners[: i % len(runners)]:
            summary[r.name].setdefault("reps", []).append(_step(r))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, summary)
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(everyone, indent=1))
        for name in names:
            for rk, s in enumerate(everyone):
                st, ca = s[name]["step"], s[name]["categories"]
                cats_text = " ".join(f"{k}={v:.2f}" for k, v in ca.items())
                print(
                    f"{name:12s} r{rk} fwd {st['fwd_wall']:.2f}s wall {st['fwd_cpu']:.2f}s cpu"
                    f" | bwd {st['bwd_wall']:.2f}s wall {st['bwd_cpu']:.2f}s cpu | {cats_text}"
                )
        if args.reps:
            print(rep_table(everyone, names, args.against))
    dist.barrier()


def rep_table(everyone: list[dict[str, Any]], names: list[str], against: str) -> str:
    """Markdown: per strategy the median over repetitions of the step's wall time (slowest
    rank) and of the busiest rank's thread CPU time, each also over ``against``'s in the same
    repetition (paired)."""

    def per_rep(name: str, key: str) -> list[float]:
        reps = len(everyone[0][name]["reps"])
        return [
            max(
                s[name]["reps"][i][f"fwd_{key}"] + s[name]["reps"][i][f"bwd_{key}"]
                for s in everyone
            )
            for i in range(reps)
        ]

    lines = [
        f"| strategy | wall s | ÷ {against} (per rep) | busiest rank CPU s | ÷ {against} (per rep) |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        cells = [name]
        for key in ("wall", "cpu"):
            mine, base = per_rep(name, key), per_rep(against, key) if against in names else None
            cells.append(f"{statistics.median(mine):.2f}")
            if base is None:
                cells.append("—")
                continue
            ratios = [a / b for a, b in zip(mine, base)]
            cells.append(
                f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "profile_step.py"))

"""One launch, whole training steps: LSS as it was (contiguous, blockwise kernel) against today's.

``scripts/benchmark.py`` picks the attention kernel once per launch (``DSPZOO_ATTENTION_KERNEL``),
so old and new LSS could only be timed in separate launches, under whatever load each met.
This script times them in **one** launch, interleaved: it builds the benchmark's model and
strategies (:class:`dspzoo.core.bench.runner.Runner`, the same step ``dspzoo bench`` times: a
forward and backward of the text model on the SP group) for each configuration

* ``lss/blockwise`` — contiguous LSS with the einsum kernel (LSS before issue 20);
* ``lss/fused`` — contiguous LSS with the fused kernel;
* ``lss_zigzag/fused`` — balanced LSS with the fused kernel (today's);

and runs one step of each per repetition, the order rotated every repetition, setting the
kernel for each step (the kernel is read from the environment at every attention call). The
step time is the slowest rank's; the table gives the median and every repetition, and the
ratios of the old configuration to the others per repetition (same moment, same load).

Usage (4 ranks, 64K bytes: the figures of ``docs/strategies_measured.md``, about 11–16 min
per round of the three on 2 shared cores)::

    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 4 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no scripts/bench_lss_step.py \\
        --model bytelm-tiny --checkpoint --seq-len 65536 --reps 2
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from dspzoo.core.bench.case import build_case
from dspzoo.core.bench.meshes import MeshCache
from dspzoo.core.bench.runner import Runner, build_parser
from dspzoo.core.parallel.methods.kernels import KERNEL_ENV

CONFIGS = (("lss", "blockwise"), ("lss", "fused"), ("lss_zigzag", "fused"))


def main() -> None:
    from dspzoo.core.accelerate import setup_accelerate

    parser = build_parser()
    parser.description = __doc__
    args = parser.parse_args()
    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    world = world_mesh.world_size
    torch.set_num_threads(args.threads or 1)
    case = build_case(args, args.batch)
    meshes = MeshCache(accelerator, built=(world_mesh,))
    runners = [Runner(name, case, world, meshes) for name, _ in CONFIGS]
    times: list[list[float]] = [[] for _ in CONFIGS]
    rounds = args.warmup + args.reps
    for i in range(rounds):
        order = list(range(len(CONFIGS)))
        order = order[i % len(order) :] + order[: i % len(order)]
        for j in order:
            os.environ[KERNEL_ENV] = CONFIGS[j][1]
            start = time.perf_counter()
            runners[j].timed_step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[j].append(float(elapsed))
            if world_mesh.is_main:
                print(f"round {i} {'/'.join(CONFIGS[j])}: {float(elapsed):.2f} s", flush=True)
    os.environ.pop(KERNEL_ENV, None)
    if world_mesh.is_main:
        print(f"\n{case.describe()} — SP {world}, one launch, {args.reps} interleaved repetitions")
        print(f"{'configuration':<20} {'median s':>9}  runs s")
        for (name, kernel), runs in zip(CONFIGS, times):
            runs_text = ", ".join(f"{t:.2f}" for t in runs)
            print(f"{name + '/' + kernel:<20} {statistics.median(runs):9.2f}  {runs_text}")
        old = times[0]
        for (name, kernel), runs in zip(CONFIGS[1:], times[1:]):
            ratios = [a / b for a, b in zip(old, runs)]
            print(
                f"lss/blockwise ÷ {name}/{kernel}: median {statistics.median(ratios):.2f}x "
                f"(per repetition: {', '.join(f'{r:.2f}' for r in ratios)})"
            )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "bench_lss_step.py"))

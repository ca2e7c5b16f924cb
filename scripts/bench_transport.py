r"""Training steps of the benchmark's strategies with the collectives on shared memory and on gloo.

    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no scripts/bench_transport.py \
        --model bytelm-small --seq-len 2048 --strategies dsp,megatron_sp,ring_zigzag,lss_zigzag

Between the processes of one host every collective of the library goes through shared memory
(``docs/comm.md``, "Collectives on one host") unless ``DSPZOO_COMM_SHM_SLOT_KIB=off`` sends it
over gloo. Two separate benchmark runs differ by ±10 % on a shared machine, more than the
transport changes a step, so this script times both transports **in one run**: it builds the
benchmark's case (:mod:`dspzoo.core.bench`, any of its flags passes through), and each
repetition runs one forward + backward step of every (strategy, transport) pair, behind a
barrier, the order reversed every other repetition (the slowest rank's wall time). It prints per
strategy the median step on each transport and the paired ratio shm / gloo (median and range
over repetitions), then each strategy's paired ratio to ``--against`` on each transport: how
the strategies rank on either transport.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dspzoo.core.argparser import CommandParser

TRANSPORTS = ("shm", "gloo")


def _step(runner: Any) -> tuple[float, float, int]:
    """One forward + backward of ``runner``'s case: the slowest rank's wall seconds, this
    rank's loss and the shared-memory exchanges it started."""
    from dspzoo.core.parallel.comm import shm

    runner.model.zero_grad(set_to_none=True)
    dist.barrier()
    exchanges = shm.exchanges_started()
    start = time.perf_counter()
    loss, _ = runner.case.step(runner.model, runner.sp, runner.inputs)
    loss.backward()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item(), loss.item(), shm.exchanges_started() - exchanges


def _paired(a: list[float], b: list[float]) -> str:
    ratios = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})"


def main(argv: list[str] | None = None) -> None:
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.meshes import MeshCache
    from dspzoo.core.bench.runner import Runner
    from dspzoo.core.bench.runner import build_parser as build_bench_parser
    from dspzoo.core.parallel.comm.settings import SETTINGS

    parser = CommandParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag of the benchmark's case (--frames, --latent, ...) is passed on.",
    )
    parser.add_argument(
        "--model", default="bytelm-small", help="the benchmark's model (dspzoo bench --help)"
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="text: bytes per sample")
    parser.add_argument(
        "--strategies",
        default="dsp,megatron_sp,ring_zigzag,lss_zigzag",
        help="comma-separated strategies to time on both transports",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    parser.add_argument("--against", default="megatron_sp", help="the per-transport ratios' base")
    parser.add_argument("--seed", type=int, default=0, help="weights and inputs")
    args, case_flags = parser.parse_known_args(argv)
    names = [s.strip() for s in args.strategies.split(",")]
    if args.against not in names:
        parser.error(f"--against {args.against} is not one of --strategies {args.strategies}")
    bench_args = build_bench_parser().parse_args(
        ["--model", args.model, "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
        + case_flags
    )
    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    torch.set_num_threads(1)
    if world_mesh.world_size < 2:
        raise SystemExit("run with at least 2 processes (accelerate launch --num_processes N)")
    if dist.get_backend() != "gloo" or accelerator.device.type != "cpu":
        raise SystemExit(
            "bench_transport compares shared memory with gloo between CPU processes; this run "
            f"is on {dist.get_backend()} / {accelerator.device.type}, where neither applies"
        )
    case = build_case(bench_args, 1)
    meshes = MeshCache(accelerator, built=(world_mesh,))
    runners = [Runner(n, case, world_mesh.world_size, meshes) for n in names]
    slot = SETTINGS.shm_slot_bytes
    if slot is None:
        raise SystemExit("DSPZOO_COMM_SHM_SLOT_KIB=off leaves nothing to compare: unset it")
    pairs = [(r, t) for r in runners for t in TRANSPORTS]
    times: dict[tuple[str, str], list[float]] = {(r.name, t): [] for r, t in pairs}
    losses: dict[tuple[str, str], float] = {}
    for i in range(-1, args.reps):  # -1: the warm-up round (each pair's first step)
        for runner, transport in pairs if i % 2 == 0 else pairs[::-1]:
            with SETTINGS.changed(shm_slot_bytes=slot if transport == "shm" else None):
                took, loss, exchanges = _step(runner)
            # each step took the transport it names (shared memory: where the group has a
            # channel, i.e. its ranks share a host), and both compute the same loss
            assert (exchanges > 0) == (transport == "shm"), (runner.name, transport, exchanges)
            assert losses.setdefault((runner.name, transport), loss) == loss, runner.name
            if i >= 0:
                times[(runner.name, transport)].append(took)
    for name in names:
        shm_loss, gloo_loss = losses[(name, "shm")], losses[(name, "gloo")]
        assert abs(shm_loss - gloo_loss) <= 1e-6 * max(1.0, abs(gloo_loss)), (
            name,
            shm_loss,
            gloo_loss,
        )
    if world_mesh.is_main:
        print(
            f"\n{case.describe()}: SP "
            f"{world_mesh.world_size}, {args.reps} interleaved repetitions, step s (slowest rank)"
        )
        print(f"{'strategy':<14} {'shm s':>8} {'gloo s':>8}   shm / gloo paired (range)")
        for name in names:
            shm_s, gloo_s = times[(name, "shm")], times[(name, "gloo")]
            print(
                f"{name:<14} {statistics.median(shm_s):8.3f} {statistics.median(gloo_s):8.3f}"
                f"   {_paired(shm_s, gloo_s)}"
            )
        print(f"\n÷ {args.against} in the same repetition, paired median (range)")
        print(f"{'strategy':<14} {'shm':>22} {'gloo':>22}")
        for name in names:
            cells = [_paired(times[(name, t)], times[(args.against, t)]) for t in TRANSPORTS]
            print(f"{name:<14} {cells[0]:>22} {cells[1]:>22}")
        flags = " ".join(case_flags)
        print(
            "\nreproduce: OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes "
            f"{world_mesh.world_size} --num_machines 1 --mixed_precision no --dynamo_backend no "
            f"scripts/bench_transport.py --model {args.model} --seq-len {args.seq_len} "
            f"--strategies {args.strategies} --reps {args.reps} --against {args.against}"
            + (f" {flags}" if flags else "")
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "bench_transport.py"))

"""Communication micro-benchmark: ``switch`` vs a bare all-to-all vs the naive switch.

Launch (2 CPU processes on gloo, or GPUs on NCCL)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py

For each activation size it times, in one run on the same tensors:

* ``bare``   — ``all_to_all_single`` of a ready, contiguous buffer with the same bytes
  (the floor: no layout work at all);
* ``switch`` — :func:`dspzoo.core.switch` from sharded-on-t to sharded-on-s of a
  ``[1, T/N, S, C]`` activation (one layout copy + one ``all_to_all_single``);
* ``naive``  — the textbook form: chunk along s, make each chunk contiguous, list
  ``all_to_all``, concatenate along t;

and checks the tracer's byte count against ``(local elements)·(N−1)/N·itemsize``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dspzoo.core import switch, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.trace import format_bytes


def timed(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median wall time of ``fn`` in seconds, with a barrier before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # the slowest rank decides
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def naive_switch(x: torch.Tensor, src: int, dst: int, n: int) -> torch.Tensor:
    """Switch as usually written: per-chunk copies, a list all-to-all and a concatenation."""
    inputs = [c.contiguous() for c in x.chunk(n, dim=dst)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=src)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64], help="local activation sizes"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--frames", type=int, default=16, help="global T (sharded dim)")
    args = parser.parse_args()

    accelerator, mesh, _ = setup_accelerate(
        sp_size=dist.get_world_size() if dist.is_initialized() else 1
    )
    n = mesh.world_size
    if n < 2:
        raise SystemExit(
            "run with at least 2 processes: accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py"
        )
    device = accelerator.device
    group = dist.group.WORLD
    rows = []
    for mib in args.sizes_mib:
        local_elems = int(mib * 2**20 / 4)
        t_local = args.frames // n
        s = max(n, local_elems // (t_local * args.channels) // n * n)
        x = torch.randn(1, t_local, s, args.channels, device=device)
        flat = x.reshape(-1).clone()
        out = torch.empty_like(flat)

        with trace_comm() as tracer:
            y = switch(x, 1, 2, group, src_length=t_local * n)
        expected = x.numel() * (n - 1) // n * x.element_size()
        measured = tracer.total_bytes("all_to_all")
        ref = naive_switch(x, 1, 2, n)
        assert torch.equal(y, ref), "switch and naive switch disagree"

        bare_s = timed(
            lambda flat=flat, out=out: dist.all_to_all_single(out, flat, group=group),
            args.iters,
            args.warmup,
        )
        switch_s = timed(
            lambda x=x, length=t_local * n: switch(x, 1, 2, group, src_length=length),
            args.iters,
            args.warmup,
        )
        naive_s = timed(lambda x=x: naive_switch(x, 1, 2, n), args.iters, args.warmup)
        rows.append(
            (
                x.numel() * x.element_size(),
                tuple(x.shape),
                bare_s,
                switch_s,
                naive_s,
                measured,
                expected,
            )
        )

    if mesh.is_main:
        print(
            f"\nswitch micro-benchmark, N = {n}, backend = {dist.get_backend()}, device = {device}, median of {args.iters}"
        )
        print(
            f"{'local size':>10} {'shape [1,T/N,S,C]':>22} {'bare ms':>9} {'switch ms':>10} {'naive ms':>9} "
            f"{'switch/bare':>12} {'naive/switch':>13} {'traced bytes':>13} {'formula':>10}"
        )
        for size, shape, bare_s, switch_s, naive_s, measured, expected in rows:
            ok = "==" if measured == expected else "!="
            print(
                f"{format_bytes(size):>10} {str(shape):>22} {bare_s * 1e3:9.2f} {switch_s * 1e3:10.2f} {naive_s * 1e3:9.2f} "
                f"{switch_s / bare_s:11.2f}x {naive_s / switch_s:12.2f}x {measured:>13} {ok} {expected}"
            )
        print(
            "\nreproduce: accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py "
            + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items()
            )
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "bench_comm.py"))

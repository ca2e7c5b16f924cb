"""Communication micro-benchmark: ``switch`` against a bare all-to-all of the same bytes.

Launch (2 CPU processes on gloo, one thread each, or GPUs on NCCL)::

    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py

For each activation size it times, interleaved (each repetition runs every variant once, in
turn, behind a barrier, odd repetitions in reverse order; the slowest rank's time), on the same
tensors:

* ``bare``      — ``all_to_all_single`` of a ready, contiguous buffer of the switch's bytes into
  a ready buffer (the backend's floor: no layout work, no checks);
* ``switch``    — :func:`dspzoo.core.switch` from sharded-on-t to sharded-on-s of a
  ``[1, T/N, S, C]`` activation as the runtime runs it inside a forward whose entry was agreed
  (:func:`~dspzoo.core.parallel.comm.trusted_calls`: no agreement of its own): layout copy,
  all-to-all, result;
* ``switch (direct call)`` — the same switch called directly, with its agreement (one tiny
  all-gather of a few words on the host);
* ``naive``     — the textbook form: chunk along s, make each chunk contiguous, list
  ``all_to_all``, concatenate along t.

It prints the median time per variant, the per-repetition ratios to ``bare`` (median and
interquartile range) and checks the tracer's byte count against ``(local elements)·(N−1)/N·
itemsize`` and that the trusted switch made no control exchange.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dspzoo.core import comm, switch, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.trace import format_bytes

VARIANTS = ("bare", "switch", "switch (direct call)", "naive")
REPRODUCE = (
    "OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes {n} --num_machines 1 "
    "--mixed_precision no --dynamo_backend no scripts/bench_comm.py --sizes-mib {sizes} "
    "--iters {iters}"
)


def timed_interleaved(
    fns: dict[str, Callable[[], object]], iters: int, warmup: int
) -> torch.Tensor:
    """Wall times (s) ``[iters, len(fns)]`` of ``fns`` run in turn every repetition, each the
    slowest rank's; a barrier precedes each call, odd repetitions run in reverse order."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = torch.zeros(iters, len(fns), dtype=torch.float64)
    order = list(enumerate(fns.values()))
    for i in range(iters):
        for j, fn in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[i, j] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times


def paired(times: torch.Tensor, a: str, b: str) -> str:
    """``a / b`` per repetition (same moment, same load): median and interquartile range."""
    ratio = times[:, VARIANTS.index(a)] / times[:, VARIANTS.index(b)]
    q25, q50, q75 = torch.quantile(ratio, torch.tensor([0.25, 0.5, 0.75], dtype=ratio.dtype))
    return f"{q50:.3f}x [{q25:.3f}-{q75:.3f}]"


def naive_switch(x: torch.Tensor, src: int, dst: int, n: int) -> torch.Tensor:
    """Switch as usually written: per-chunk copies, a list all-to-all and a concatenation."""
    inputs = [c.contiguous() for c in x.chunk(n, dim=dst)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=src)


def main() -> None:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64], help="local activation sizes"
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--frames", type=int, default=16, help="global T (the sharded dim)")
    args = parser.parse_args()

    accelerator, _, _ = setup_accelerate(sp_size=1)
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise SystemExit(
            "bench_comm.py: run with at least 2 processes: "
            + REPRODUCE.format(n=2, sizes="1 4 16 64", iters=args.iters)
        )
    n, rank = dist.get_world_size(), dist.get_rank()
    group, device = dist.group.WORLD, accelerator.device
    main_rank = rank == 0
    rows = []
    for size in args.sizes_mib:
        t_local = args.frames // n
        s = max(n, round(size * 2**20 / 4 / (t_local * args.channels) / n) * n)
        x = torch.randn(1, t_local, s, args.channels, device=device)
        moved = x.numel() * (n - 1) // n * x.element_size()
        send = torch.randn(x.numel(), device=device)
        recv = torch.empty_like(send)

        def trusted(x: torch.Tensor = x) -> torch.Tensor:
            with comm.trusted_calls(group):
                return switch(x, 1, 2, group, src_length=args.frames)

        fns = {
            "bare": lambda send=send, recv=recv: dist.all_to_all_single(recv, send, group=group),
            "switch": trusted,
            "switch (direct call)": lambda x=x: switch(x, 1, 2, group, src_length=args.frames),
            "naive": lambda x=x: naive_switch(x, 1, 2, n),
        }
        with trace_comm() as tracer:
            trusted()
        assert tracer.total_bytes("all_to_all") == moved, (tracer.total_bytes(), moved)
        assert tracer.control_count() == 0, "the trusted switch made a control exchange"
        times = timed_interleaved(fns, args.iters, args.warmup)
        rows.append((x.numel() * x.element_size(), times))
    if main_rank:
        print(f"switch t -> s of [1, T/{n}, S, {args.channels}] fp32 on {n} ranks "
              f"({dist.get_backend()}, {device}); median ms per call, slowest rank")  # fmt: skip
        print(f"{'local':>10} " + " ".join(f"{v:>20}" for v in VARIANTS))
        for nbytes, times in rows:
            med = times.median(dim=0).values * 1e3
            print(f"{format_bytes(nbytes):>10} " + " ".join(f"{m:>20.3f}" for m in med.tolist()))
        print("\nratios per repetition (both variants timed back to back): median [25%-75%]")
        print(
            f"{'local':>10} {'switch / bare':>24} {'direct call / bare':>24} {'naive / bare':>24}"
        )
        for nbytes, times in rows:
            cells = [paired(times, v, "bare") for v in VARIANTS[1:]]
            print(f"{format_bytes(nbytes):>10} " + " ".join(f"{c:>24}" for c in cells))
        sizes = " ".join(f"{s:g}" for s in args.sizes_mib)
        print("\nreproduce: " + REPRODUCE.format(n=n, sizes=sizes, iters=args.iters))


if __name__ == "__main__":
    main()

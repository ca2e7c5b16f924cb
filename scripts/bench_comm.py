"""Communication micro-benchmark: ``switch`` and its agreement vs a bare all-to-all.

Launch (2 CPU processes on gloo, or GPUs on NCCL)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py

For each activation size it times, interleaved (each repetition runs every variant once, in
turn, behind a barrier; the median per variant, the slowest rank's), on the same tensors:

* ``bare``    — ``all_to_all_single`` of a ready, contiguous buffer with the same bytes
  (the floor: no layout work, no checks);
* ``agree+bare`` — the agreement a checked switch makes (one tiny all-gather of the call's
  signature and the checks on it, :func:`dspzoo.core.parallel.comm.exchange.agree_switch`) followed
  by the bare all-to-all: ``agree+bare / bare`` is the agreement's cost beside the
  all-to-all (the target is within 5 %);
* ``switch``  — :func:`dspzoo.core.switch` from sharded-on-t to sharded-on-s of a
  ``[1, T/N, S, C]`` activation: agreement, one layout copy, one ``all_to_all_single``;
* ``unchecked`` — the same switch without its agreement (``switch_agreed``, what attention
  methods use after agreeing once at entry): ``switch / unchecked`` is the agreement's share
  of a real switch;
* ``naive``   — the textbook form: chunk along s, make each chunk contiguous, list
  ``all_to_all``, concatenate along t;

and checks the tracer's byte count against ``(local elements)·(N−1)/N·itemsize`` (the
agreement is control traffic and is not traced).
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
from dspzoo.core.parallel.comm.exchange import agree_switch, switch_agreed
from dspzoo.core.parallel.trace import format_bytes


def timed_interleaved(
    fns: dict[str, Callable[[], object]], iters: int, warmup: int
) -> dict[str, float]:
    """Median wall time (s) of each of ``fns``, run in turn every repetition (interleaved).

    A barrier precedes each call; the slowest rank's median decides.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(fns, medians.tolist()))


def naive_switch(x: torch.Tensor, src: int, dst: int, n: int) -> torch.Tensor:
    """Switch as usually written: per-chunk copies, a list all-to-all and a concatenation."""
    inputs = [c.contiguous() for c in x.chunk(n, dim=dst)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
    dist.all_to_all(outputs, inputs)
    return torch.cat(outputs, dim=src)


VARIANTS = ("bare", "agree+bare", "switch", "unchecked", "naive")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes-mib", type=float, nargs="+", default=[1, 16], help="local activation sizes"
    )
    parser.add_argument("--iters", type=int, default=30)
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
    group = dist.group.WORLD  # the mesh above has sp_size 1 (dist starts inside it)
    rows = []
    t_local = args.frames // n
    length = t_local * n
    for mib in args.sizes_mib:
        local_elems = int(mib * 2**20 / 4)
        s = max(n, local_elems // (t_local * args.channels) // n * n)
        x = torch.randn(1, t_local, s, args.channels, device=device)
        flat = x.reshape(-1).clone()
        out = torch.empty_like(flat)

        with trace_comm() as tracer:
            y = switch(x, 1, 2, group, src_length=length)
        expected = x.numel() * (n - 1) // n * x.element_size()
        measured = tracer.total_bytes("all_to_all")
        ref = naive_switch(x, 1, 2, n)
        assert torch.equal(y, ref), "switch and naive switch disagree"
        assert torch.equal(switch_agreed(x, 1, 2, group, src_length=length), ref)

        def bare(flat: torch.Tensor = flat, out: torch.Tensor = out) -> None:
            dist.all_to_all_single(out, flat, group=group)

        def agree_then_bare(x: torch.Tensor = x) -> None:
            agree_switch(x, 1, 2, group, length, None, None, "switch")
            bare()

        variants: dict[str, Callable[[], object]] = {
            "bare": bare,
            "agree+bare": agree_then_bare,
            "switch": lambda x=x: switch(x, 1, 2, group, src_length=length),
            "unchecked": lambda x=x: switch_agreed(x, 1, 2, group, src_length=length),
            "naive": lambda x=x: naive_switch(x, 1, 2, n),
        }
        rows.append(
            (
                x.numel() * x.element_size(),
                tuple(x.shape),
                timed_interleaved(variants, args.iters, args.warmup),
                measured,
                expected,
            )
        )

    if mesh.is_main:
        print(
            f"\nswitch micro-benchmark, N = {n}, backend = {dist.get_backend()}, device = {device}, "
            f"median of {args.iters} interleaved repetitions (slowest rank)"
        )
        print(
            f"{'local size':>10} {'shape [1,T/N,S,C]':>22} "
            + " ".join(f"{v + ' ms':>14}" for v in VARIANTS)
            + f" {'agree+bare/bare':>16} {'switch/unchecked':>17} {'switch/bare':>12}"
            f" {'naive/switch':>13} {'traced bytes':>13} {'formula':>10}"
        )
        for size, shape, t, measured, expected in rows:
            ok = "==" if measured == expected else "!="
            print(
                f"{format_bytes(size):>10} {str(shape):>22} "
                + " ".join(f"{t[v] * 1e3:14.3f}" for v in VARIANTS)
                + f" {t['agree+bare'] / t['bare']:15.3f}x {t['switch'] / t['unchecked']:16.3f}x"
                f" {t['switch'] / t['bare']:11.3f}x {t['naive'] / t['switch']:12.3f}x"
                f" {measured:>13} {ok} {expected}"
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

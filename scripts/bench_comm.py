"""Communication micro-benchmark: ``switch`` and its agreement vs a bare all-to-all.

Launch (2 CPU processes on gloo, or GPUs on NCCL)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py

For each activation size it times, interleaved (each repetition runs every variant once, in
turn, behind a barrier; the median per variant, the slowest rank's), on the same tensors:

* ``bare``    — ``all_to_all_single`` of a ready, contiguous buffer with the same bytes
  (the floor: no layout work, no checks);
* ``agree+bare`` — the full agreement (one tiny all-gather of the call's signature and the
  checks on it: what a switch's first call, or a call the group did not predict, costs;
  :func:`dspzoo.core.parallel.comm.exchange.agree_switch` with ``in_full``) followed by the bare
  all-to-all;
* ``switch``  — :func:`dspzoo.core.switch` from sharded-on-t to sharded-on-s of a
  ``[1, T/N, S, C]`` activation, in its steady state: the group rehearsed the call, so its
  agreement is folded into the all-to-all (a status header per chunk, no collective of its own;
  :mod:`dspzoo.core.parallel.comm.rehearsal`): one layout copy, one ``all_to_all_single``;
* ``unchecked`` — the same switch without any agreement (``switch_agreed``, what attention
  methods use after agreeing once at entry): ``switch / unchecked`` is the agreement's cost in
  a real switch (the target is within 5 %), and ``(switch − unchecked) / bare`` the same cost
  beside the bare all-to-all;
* ``switch (recycled)`` — ``switch`` with results on recycled storages
  (``SETTINGS.recycle_results`` on, ``DSPZOO_COMM_RECYCLE_RESULTS=1``; off by default, since it
  measured no gain), timed in the same run for the ratio;
* ``naive``   — the textbook form: chunk along s, make each chunk contiguous, list
  ``all_to_all``, concatenate along t;

and checks the tracer's byte count against ``(local elements)·(N−1)/N·itemsize`` (the
agreement is control traffic and is not traced), and that every timed ``switch`` ran folded.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dspzoo.core import switch, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.comm.exchange import agree_switch, switch_agreed
from dspzoo.core.parallel.comm.settings import SETTINGS
from dspzoo.core.parallel.trace import format_bytes


def timed_interleaved(
    fns: dict[str, Callable[[], object]], iters: int, warmup: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wall and CPU times (s), each ``[iters, len(fns)]``, of ``fns`` run in turn every repetition.

    A barrier precedes each call; each wall time is the slowest rank's time of that call, each
    CPU time the larger of the ranks' process CPU time (all threads, the backend's included)
    during the call: the work a call does, which the load of other users does not inflate as
    much as its wall time. Odd repetitions run the variants in reverse order, so that no
    variant always follows the same one (what a call leaves behind — freed buffers, a busy
    peer — falls on each alike).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = torch.zeros(iters, len(fns), dtype=torch.float64)
    cpu = torch.zeros(iters, len(fns), dtype=torch.float64)
    order = list(enumerate(fns.values()))
    for i in range(iters):
        for j, fn in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[i, j] = time.perf_counter() - start
            cpu[i, j] = time.process_time() - start_cpu
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return times, cpu


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


VARIANTS = ("bare", "agree+bare", "switch", "switch (recycled)", "unchecked", "naive")


def recycled_results(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with collective results on the group's recycled storages."""

    def run() -> object:
        previous, SETTINGS.recycle_results = SETTINGS.recycle_results, True
        try:
            return fn()
        finally:
            SETTINGS.recycle_results = previous

    return run


def main() -> None:
    parser = CommandParser(
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
    rows, cpu_rows = [], []
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
            agree_switch(x, 1, 2, group, length, None, None, "switch", in_full=True)
            bare()

        variants: dict[str, Callable[[], object]] = {
            "bare": bare,
            "agree+bare": agree_then_bare,
            "switch": lambda x=x: switch(x, 1, 2, group, src_length=length),
            "switch (recycled)": recycled_results(
                lambda x=x: switch(x, 1, 2, group, src_length=length)
            ),
            "unchecked": lambda x=x: switch_agreed(x, 1, 2, group, src_length=length),
            "naive": lambda x=x: naive_switch(x, 1, 2, n),
        }
        agree_then_bare()  # the group learns the timed sequence: agreement, then the switch
        switch(x, 1, 2, group, src_length=length)
        rehearsal = SETTINGS.rehearsal(group)
        hits, misses = rehearsal.hits, rehearsal.misses
        timed, cpu = timed_interleaved(variants, args.iters, args.warmup)
        folded = (rehearsal.hits - hits, rehearsal.misses - misses)
        assert folded == (2 * (args.iters + args.warmup), 0), (
            f"folded switches (hits, misses): {folded}"
        )
        rows.append((x.numel() * x.element_size(), tuple(x.shape), timed, measured, expected))
        cpu_rows.append(cpu)

    if mesh.is_main:
        print(
            f"\nswitch micro-benchmark, N = {n}, backend = {dist.get_backend()}, device = {device}, "
            f"median of {args.iters} interleaved repetitions (slowest rank per call)"
        )
        print(
            f"{'local size':>10} {'shape [1,T/N,S,C]':>22} "
            + " ".join(f"{v + ' ms':>14}" for v in VARIANTS)
            + f" {'switch/unchecked':>17} {'(sw-unch)/bare':>15} {'agree+bare/bare':>16}"
            f" {'switch/bare':>12} {'recyc/bare':>11} {'recyc/switch':>13} {'naive/switch':>13}"
            f" {'traced bytes':>13} {'formula':>10}"
        )
        for size, shape, times, measured, expected in rows:
            t = dict(zip(VARIANTS, times.median(dim=0).values.tolist()))
            ok = "==" if measured == expected else "!="
            print(
                f"{format_bytes(size):>10} {str(shape):>22} "
                + " ".join(f"{t[v] * 1e3:14.3f}" for v in VARIANTS)
                + f" {t['switch'] / t['unchecked']:16.3f}x"
                f" {(t['switch'] - t['unchecked']) / t['bare']:+14.3f}x"
                f" {t['agree+bare'] / t['bare']:15.3f}x"
                f" {t['switch'] / t['bare']:11.3f}x {t['switch (recycled)'] / t['bare']:10.3f}x"
                f" {t['switch (recycled)'] / t['switch']:12.3f}x {t['naive'] / t['switch']:12.3f}x"
                f" {measured:>13} {ok} {expected}"
            )
        print("\nCPU time per call (process, all threads; larger rank), median ms, and / bare")
        for (size, _, _, _, _), cpu in zip(rows, cpu_rows):
            c = dict(zip(VARIANTS, cpu.median(dim=0).values.tolist()))
            print(
                f"{format_bytes(size):>10}  "
                + "  ".join(f"{v} {c[v] * 1e3:.3f} ({c[v] / c['bare']:.2f}x)" for v in VARIANTS)
            )
        print("\nratios per repetition (both variants timed back to back): median [25%-75%]")
        for size, _, times, _, _ in rows:
            print(
                f"{format_bytes(size):>10}  switch/unchecked {paired(times, 'switch', 'unchecked')}"
                f"   agree+bare/bare {paired(times, 'agree+bare', 'bare')}"
                f"   switch/bare {paired(times, 'switch', 'bare')}"
                f"   recycled/switch {paired(times, 'switch (recycled)', 'switch')}"
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

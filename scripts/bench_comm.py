"""Communication micro-benchmark: ``switch`` and its agreement vs a bare all-to-all.

Launch (2 CPU processes on gloo, one thread each, or GPUs on NCCL)::

    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py

For each activation size it times, interleaved (each repetition runs every variant once, in
turn, behind a barrier; the median per variant, the slowest rank's), on the same tensors:

* ``bare``    — ``all_to_all_single`` of a ready, contiguous buffer with the same bytes
  (gloo's floor: no layout work, no checks);
* ``bare (shm)`` — the same ready, contiguous blocks through the group's shared-memory channel
  (:func:`dspzoo.core.parallel.comm.shm.start_blocks`, own block copied while the peers take
  theirs): the shared-memory transport's floor, what its switch is measured against (gloo
  only, on a group of its own; elsewhere the gloo figure again);
* ``agree+bare`` — the full agreement (one tiny all-gather of the call's signature and the
  checks on it: what a switch's first call, or a call the group did not predict, costs;
  :func:`dspzoo.core.parallel.comm.exchange.agree_switch` with ``in_full``) followed by the bare
  all-to-all;
* ``switch``  — :func:`dspzoo.core.switch` from sharded-on-t to sharded-on-s of a
  ``[1, T/N, S, C]`` activation, in its steady state: the group rehearsed the call, so its
  agreement is folded into the all-to-all (a status header per chunk, no collective of its own;
  :mod:`dspzoo.core.parallel.comm.rehearsal`), on the path the default settings pick for it
  (column ``path``): shm (ranks of one host on gloo: chunks through shared memory, straight
  from the input into the result, :mod:`dspzoo.core.parallel.comm.shm`), packed (one layout
  copy, one ``all_to_all_single``) or direct (one point-to-point message per contiguous run,
  status words as messages of their own);
* ``switch (recycled)`` — ``switch`` with its result on a recycled storage of the group
  (``SETTINGS.recycle_results``, ``DSPZOO_COMM_RECYCLE_RESULTS=1``): no page faults on first
  write, as the bare all-to-all's reused output buffer has none;
* ``unchecked`` — the same switch without any agreement (``switch_agreed``, what attention
  methods use after agreeing once at entry): ``switch / unchecked`` is the agreement's cost in
  a real switch;
* ``switch (packed)``, ``switch (direct)`` and ``switch (shm)`` — the same steady-state switch
  with its path forced: the blocks packed into one ``all_to_all_single``, sent as
  point-to-point messages straight from the input into the result
  (:mod:`dspzoo.core.parallel.comm.direct`), or through shared memory (gloo only: on NCCL all
  three are packed). Each runs on a group of its own (same ranks), which learnt the call with
  that path;
* ``shm (no doorbell)`` — ``switch (shm)`` with ``SETTINGS.shm_doorbell`` off, on a group of its
  own: a rank that waits longer than 200 µs sleeps 50 µs – 1 ms between polls instead of dozing
  on a doorbell its peer rings (what the doorbell saves where ranks wait for each other: more
  ranks than cores, or ranks that reach the switch at different times);
* ``naive``   — the textbook form: chunk along s, make each chunk contiguous, list
  ``all_to_all``, concatenate along t;

Then, at the first size, a **late peer**: the last rank computes ``D`` ms (``--late-ms``, a busy
loop) before its switch while the others wait in theirs; the time from the late rank's call to
the last other rank's result is what the switch costs once everyone is there, waiting
included — ``switch (shm)`` against ``shm (no doorbell)``, interleaved.

It checks the tracer's byte count against ``(local elements)·(N−1)/N·itemsize`` (the
agreement is control traffic and is not traced), that every timed ``switch`` ran folded, and
that every switch took the path its variant names.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dspzoo.core import switch, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.comm import direct, shm
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


VARIANTS = (
    "bare",
    "bare (shm)",
    "agree+bare",
    "switch",
    "switch (packed)",
    "switch (direct)",
    "switch (shm)",
    "shm (no doorbell)",
    "switch (recycled)",
    "unchecked",
    "naive",
)


def with_settings(fn: Callable[[], object], **changes: Any) -> Callable[[], object]:
    """``fn`` run with these comm settings (``SETTINGS.changed``)."""

    def run() -> object:
        with SETTINGS.changed(**changes):
            return fn()

    return run


def _started() -> dict[str, int]:
    """Exchanges started so far by this process on the shared-memory and direct paths."""
    return {"shm": shm.exchanges_started(), "direct": direct.exchanges_started()}


def _path_since(started: dict[str, int]) -> str:
    """The path the switches since ``started`` took (packed when neither counter moved)."""
    now = _started()
    moved = [k for k in now if now[k] > started[k]]
    return moved[0] if len(moved) == 1 else "packed" if not moved else "+".join(moved)


def _messages(shape: tuple[int, ...], n: int) -> str:
    """The direct path's messages to each peer for a ``[1, T/N, S, C]`` fp32 switch t → s."""
    _, t_local, s, c = shape
    return f"{t_local} x {format_bytes(s // n * c * 4)}"


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
    parser.add_argument(
        "--late-ms",
        type=float,
        nargs="*",
        default=[0.5, 2.0, 5.0],
        help="the last rank's compute before its switch in the late-peer table (none: skip it)",
    )
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
    # one group per forced path: a group folds a call with the path it learnt it on
    packed_group, direct_group, shm_group, bare_shm_group, no_bell_group = (
        dist.new_group(list(range(n))) for _ in range(5)
    )
    bare_channel = shm.transfer_channel(bare_shm_group, device)
    on_gloo_cpu = dist.get_backend() == "gloo" and device.type == "cpu"  # where paths differ
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

        def bare_shm(flat: torch.Tensor = flat, out: torch.Tensor = out) -> None:
            if bare_channel is None:  # not on gloo between processes of one host
                return bare(flat, out)
            blocks, landing = list(flat.view(n, -1)), list(out.view(n, -1))
            shm.start_blocks(bare_channel, blocks, landing, "bare exchange").wait()

        def agree_then_bare(x: torch.Tensor = x) -> None:
            agree_switch(x, 1, 2, group, length, None, None, "switch", in_full=True)
            bare()

        def switched(g: Any = group, x: torch.Tensor = x) -> torch.Tensor:
            return switch(x, 1, 2, g, src_length=length)

        variants: dict[str, Callable[[], object]] = {
            "bare": bare,
            "bare (shm)": bare_shm,
            "agree+bare": agree_then_bare,
            "switch": switched,
            "switch (packed)": with_settings(
                lambda: switched(packed_group), direct_min_bytes=None, shm_slot_bytes=None
            ),
            "switch (direct)": with_settings(
                lambda: switched(direct_group),
                direct_min_bytes=0,
                direct_max_messages=10**6,
                shm_slot_bytes=None,
            ),
            "switch (shm)": lambda: switched(shm_group),
            "shm (no doorbell)": with_settings(lambda: switched(no_bell_group), shm_doorbell=False),
            "switch (recycled)": with_settings(switched, recycle_results=True),
            "unchecked": lambda x=x: switch_agreed(x, 1, 2, group, src_length=length),
            "naive": lambda x=x: naive_switch(x, 1, 2, n),
        }
        bare()
        gloo_out = out.clone()
        bare_shm()
        assert torch.equal(out, gloo_out), "the shared-memory and gloo all-to-alls disagree"
        agree_then_bare()  # each group learns the timed sequence: agreement, then the switch
        started = _started()
        switched()
        path = _path_since(started)
        forced = {
            "switch (packed)": "packed",
            "switch (direct)": "direct",
            "switch (shm)": "shm",
            "shm (no doorbell)": "shm",
        }
        for name in forced:
            variants[name]()
        for name, wanted in forced.items():
            started = _started()
            assert torch.equal(variants[name](), ref), name
            assert not on_gloo_cpu or _path_since(started) == wanted, (name, _path_since(started))
        groups = (group, packed_group, direct_group, shm_group, no_bell_group)
        counts = [SETTINGS.rehearsal(g) for g in groups]
        before = [(c.hits, c.misses) for c in counts]
        started = _started()
        timed, cpu = timed_interleaved(variants, args.iters, args.warmup)
        calls = args.iters + args.warmup
        folded = [(c.hits - h, c.misses - m) for c, (h, m) in zip(counts, before)]
        assert folded == [(2 * calls, 0)] + [(calls, 0)] * 4, (
            f"folded switches (hits, misses) per group: {folded}"
        )
        # switch, recycled and unchecked take the default path; each forced variant its own
        want = {"shm": calls * (2 if bare_channel is None else 3), "direct": calls}
        if path in want:
            want[path] += 3 * calls
        if not on_gloo_cpu:
            want = {"shm": 0, "direct": 0}
        got = {k: v - started[k] for k, v in _started().items()}
        assert got == want, f"exchanges per path {got}, expected {want}"
        rows.append((x.numel() * x.element_size(), tuple(x.shape), timed, measured, expected, path))
        cpu_rows.append(cpu)
        if len(rows) == 1 and args.late_ms:
            late = {name: variants[name] for name in ("switch (shm)", "shm (no doorbell)")}
            late_rows = [
                (ms, late_peer(late, ms * 1e-3, n - 1, args.iters, args.warmup))
                for ms in args.late_ms
            ]

    if mesh.is_main:
        print(
            f"\nswitch micro-benchmark, N = {n}, backend = {dist.get_backend()}, device = {device}, "
            f"median of {args.iters} interleaved repetitions (slowest rank per call)"
        )
        print(
            f"{'local size':>10} {'shape [1,T/N,S,C]':>22} {'messages/peer':>16} {'path':>6} "
            + " ".join(f"{v + ' ms':>17}" for v in VARIANTS)
            + f" {'switch/bare':>12} {'switch/bare(shm)':>17} {'packed/bare':>12}"
            f" {'direct/bare':>12} {'shm/bare':>12}"
            f" {'recyc/bare':>11}"
            f" {'switch/unchecked':>17} {'agree+bare/bare':>16} {'naive/switch':>13}"
            f" {'traced bytes':>13} {'formula':>10}"
        )
        for size, shape, times, measured, expected, path in rows:
            t = dict(zip(VARIANTS, times.median(dim=0).values.tolist()))
            ok = "==" if measured == expected else "!="
            print(
                f"{format_bytes(size):>10} {str(shape):>22} {_messages(shape, n):>16} {path:>6} "
                + " ".join(f"{t[v] * 1e3:17.3f}" for v in VARIANTS)
                + f" {t['switch'] / t['bare']:11.3f}x"
                f" {t['switch'] / t['bare (shm)']:16.3f}x"
                f" {t['switch (packed)'] / t['bare']:11.3f}x"
                f" {t['switch (direct)'] / t['bare']:11.3f}x"
                f" {t['switch (shm)'] / t['bare']:11.3f}x"
                f" {t['switch (recycled)'] / t['bare']:10.3f}x"
                f" {t['switch'] / t['unchecked']:16.3f}x"
                f" {t['agree+bare'] / t['bare']:15.3f}x {t['naive'] / t['switch']:12.3f}x"
                f" {measured:>13} {ok} {expected}"
            )
        print("\nCPU time per call (process, all threads; larger rank), median ms, and / bare")
        for (size, *_), cpu in zip(rows, cpu_rows):
            c = dict(zip(VARIANTS, cpu.median(dim=0).values.tolist()))
            print(
                f"{format_bytes(size):>10}  "
                + "  ".join(f"{v} {c[v] * 1e3:.3f} ({c[v] / c['bare']:.2f}x)" for v in VARIANTS)
            )
        print("\nratios per repetition (both variants timed back to back): median [25%-75%]")
        for size, _, times, *_ in rows:
            print(
                f"{format_bytes(size):>10}  switch/bare {paired(times, 'switch', 'bare')}"
                f"   switch/bare(shm) {paired(times, 'switch', 'bare (shm)')}"
                f"   bare(shm)/bare {paired(times, 'bare (shm)', 'bare')}"
                f"   packed/bare {paired(times, 'switch (packed)', 'bare')}"
                f"   direct/bare {paired(times, 'switch (direct)', 'bare')}"
                f"   direct/packed {paired(times, 'switch (direct)', 'switch (packed)')}"
                f"   shm/bare {paired(times, 'switch (shm)', 'bare')}"
                f"   shm/packed {paired(times, 'switch (shm)', 'switch (packed)')}"
                f"   shm/no-doorbell {paired(times, 'switch (shm)', 'shm (no doorbell)')}"
                f"   switch/unchecked {paired(times, 'switch', 'unchecked')}"
                f"   recycled/bare {paired(times, 'switch (recycled)', 'bare')}"
            )
        print(
            "\nreproduce: OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes "
            f"{n} --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_comm.py "
            + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items()
            )
        )
    if mesh.is_main and args.late_ms:
        print(
            f"\nlate peer ({format_bytes(rows[0][0])}): rank {n - 1} computes D ms before its "
            "switch; from its call to the last other rank's result, median, and the ratio per "
            "repetition: median [25%-75%]"
        )
        for ms, times in late_rows:
            shm_ms, no_bell_ms = (times.median(dim=0).values * 1e3).tolist()
            ratio = times[:, 0] / times[:, 1]
            q25, q50, q75 = torch.quantile(
                ratio, torch.tensor([0.25, 0.5, 0.75], dtype=ratio.dtype)
            )
            print(
                f"  D {ms:4g} ms   switch (shm) {shm_ms:.3f} ms   shm (no doorbell) "
                f"{no_bell_ms:.3f} ms   shm/no-doorbell {q50:.3f}x [{q25:.3f}-{q75:.3f}]"
            )
    accelerator.wait_for_everyone()


def late_peer(
    fns: dict[str, Callable[[], object]], late_s: float, late_rank: int, iters: int, warmup: int
) -> torch.Tensor:
    """``[iters, len(fns)]`` times (s) from the moment ``late_rank``, after busy-waiting
    ``late_s``, starts its call to the moment the last punctual rank has its result (one
    monotonic clock: the ranks share a host). The variants in turn, odd repetitions reversed,
    a barrier before each call."""
    rank = dist.get_rank()
    order = list(enumerate(fns.values()))
    ready = torch.full((iters, len(fns)), -math.inf, dtype=torch.float64)
    done = ready.clone()
    for i in range(-warmup, iters):
        for j, fn in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            if rank == late_rank:
                until = time.perf_counter() + late_s
                while time.perf_counter() < until:
                    pass
                start = time.perf_counter()
            fn()
            if i >= 0:
                if rank == late_rank:
                    ready[i, j] = start
                else:
                    done[i, j] = time.perf_counter()
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return done - ready


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "bench_comm.py"))

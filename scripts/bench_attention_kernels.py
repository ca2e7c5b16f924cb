"""Benchmark the shared attention kernel: fused vs blockwise, in ring_zigzag and LSS, on CPU.

One causal attention (forward + backward) over a long sequence sharded on ``N`` gloo ranks,
as a 1-D causal LM's layer runs it, for each (method, kernel):

* ``ring_zigzag`` — :func:`~dspzoo.core.parallel.methods.ring.ring_attention`, zigzag layout;
* ``lss`` — :func:`~dspzoo.core.parallel.methods.lss.lss_attention`, contiguous (today's LSS);
* ``lss_zigzag`` — the same on the zigzag layout (every rank the same causal work);

with ``kernel="blockwise"`` (the einsum kernel: one score block per call) and ``"fused"``
(PyTorch's fused CPU attention with its log-sum-exp). Repetitions are interleaved (the
configurations run in a rotated order each repetition) so that load from other jobs on the
machine spreads over all of them; the step time is the worst rank's, the median over
repetitions. The busiest rank's CPU time (its thread's, waits excluded) is the step time each
rank would see on a core of its own — on an oversubscribed machine, ranks that finish early
lend their core to the others, which hides load imbalance from the step time. Peak memory is the largest increase of the process's resident set during the
call, sampled every 2 ms, worst rank (glibc's mmap threshold is pinned at 64 KiB so that freed
blocks go back to the system and the samples see each call's own peak).

Usage (the figures of ``docs/strategies_measured.md`` came from)::

    OMP_NUM_THREADS=1 python scripts/bench_attention_kernels.py --seq-len 8192 --sp 2 4 --reps 3
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from dataclasses import dataclass

import torch

CONFIGS = (
    ("ring_zigzag", "blockwise"),
    ("ring_zigzag", "fused"),
    ("lss", "blockwise"),
    ("lss", "fused"),
    ("lss_zigzag", "blockwise"),
    ("lss_zigzag", "fused"),
)


@dataclass(frozen=True)
class Shape:
    """The attention: ``batch`` lines of ``seq_len`` tokens, ``heads`` of ``head_dim``."""

    seq_len: int
    batch: int = 1
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """Largest resident-set increase over the value at entry, sampled in a thread."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def increase(self) -> int:
        return self.peak - self.base


def _pin_mmap_threshold() -> None:
    """glibc: allocations >= 64 KiB are mmapped and returned to the system when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def _run_one(method: str, kernel: str, shape: Shape, group, tensors, positions, lengths):
    from dspzoo.core.parallel.methods.lss import lss_attention
    from dspzoo.core.parallel.methods.ring import ring_attention

    q, k, v, w = (t[:, positions].clone() for t in tensors)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    if method == "ring_zigzag":
        out = ring_attention(
            q, k, v, group=group, seq_lengths=lengths, causal=True, layout="zigzag", kernel=kernel
        )
    else:
        layout = "zigzag" if method == "lss_zigzag" else "contiguous"
        out = lss_attention(
            q, k, v, group=group, seq_lengths=lengths, causal=True, layout=layout, kernel=kernel
        )
    (out * w).sum().backward()
    return out.detach()


def _worker(rank: int, world: int, shape: Shape, reps: int, configs: tuple) -> dict:
    import torch.distributed as dist

    from dspzoo.core.parallel.layout import shard_sizes
    from dspzoo.core.parallel.methods.ring import ring_positions, zigzag_lengths

    torch.set_num_threads(1)
    _pin_mmap_threshold()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    s = shape
    tensors = [
        torch.randn(s.batch, s.seq_len, s.heads, s.head_dim, generator=gen),
        torch.randn(s.batch, s.seq_len, s.kv_heads, s.head_dim, generator=gen),
        torch.randn(s.batch, s.seq_len, s.kv_heads, s.head_dim, generator=gen),
        torch.randn(s.batch, s.seq_len, s.heads, s.head_dim, generator=gen),
    ]
    layouts = {}
    for method, _ in configs:
        zigzag = method.endswith("zigzag")
        lengths = zigzag_lengths(s.seq_len, world) if zigzag else shard_sizes(s.seq_len, world)
        pos = ring_positions(lengths, rank, "zigzag" if zigzag else "contiguous")
        layouts[method] = (pos, lengths)
    times: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    cpus: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    peaks: dict[tuple[str, str], int] = dict.fromkeys(configs, 0)
    outs: dict[tuple[str, str], torch.Tensor] = {}
    for rep in range(reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for method, kernel in order:
            pos, lengths = layouts[method]
            dist.barrier(group)
            with PeakRss() as meter:
                start, cpu = time.perf_counter(), time.thread_time()
                out = _run_one(method, kernel, shape, group, tensors, pos, lengths)
                elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
            worst = torch.tensor([elapsed, float(meter.increase), cpu], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            times[(method, kernel)].append(float(worst[0]))
            cpus[(method, kernel)].append(float(worst[2]))
            peaks[(method, kernel)] = max(peaks[(method, kernel)], int(worst[1]))
            if rep == 0:
                outs[(method, kernel)] = out
    # the two kernels agree (worst rank)
    diffs = {}
    for method in sorted({m for m, _ in configs}):
        if (method, "fused") not in outs or (method, "blockwise") not in outs:
            continue
        d = (outs[(method, "fused")] - outs[(method, "blockwise")]).abs().max()
        d = d.reshape(1).double()
        dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)
        diffs[method] = float(d)
    return {"times": times, "cpus": cpus, "peaks": peaks, "diffs": diffs}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=[f"{m}:{k}" for m, k in CONFIGS],
        help="method:kernel pairs to run (default: all six)",
    )
    args = parser.parse_args()

    from dspzoo.core.testing import run_distributed

    configs = tuple(tuple(c.split(":")) for c in args.configs)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; choose from {[':'.join(c) for c in CONFIGS]}")

    shape = Shape(args.seq_len, heads=args.heads, kv_heads=args.heads, head_dim=args.head_dim)
    print(
        f"causal attention, batch {shape.batch}, L {shape.seq_len}, heads {shape.heads}, "
        f"head dim {shape.head_dim}, fp32, forward + backward; median of {args.reps} "
        f"interleaved repetitions, worst rank"
    )
    for n in args.sp:
        result = run_distributed(_worker, n, shape, args.reps, configs, timeout=args.timeout)[0]
        times = {c: statistics.median(t) for c, t in result["times"].items()}
        print(f"\nSP {n}")
        print("| method | kernel | step s | runs s | busiest rank's CPU s | peak MiB/rank |")
        print("|---|---|---|---|---|---|")
        for c in configs:
            runs = ", ".join(f"{t:.2f}" for t in result["times"][c])
            cpu = statistics.median(result["cpus"][c])
            peak = result["peaks"][c] / 2**20
            print(f"| {c[0]} | {c[1]} | {times[c]:.2f} | {runs} | {cpu:.2f} | {peak:.0f} |")
        for method in ("ring_zigzag", "lss", "lss_zigzag"):
            if method not in result["diffs"]:
                continue
            ratio = times[(method, "blockwise")] / times[(method, "fused")]
            mem = result["peaks"][(method, "blockwise")] / max(
                result["peaks"][(method, "fused")], 1
            )
            print(
                f"{method}: blockwise / fused step time {ratio:.2f}x, peak memory {mem:.1f}x "
                f"(max |out difference| {result['diffs'][method]:.1e})"
            )
        pairs = {
            "lss today (contiguous, blockwise) / lss_zigzag fused": (
                ("lss", "blockwise"),
                ("lss_zigzag", "fused"),
            ),
            "lss contiguous / zigzag, both fused": (("lss", "fused"), ("lss_zigzag", "fused")),
        }
        for label, (before, after) in pairs.items():
            if before in times and after in times:
                print(f"{label}: {times[before] / times[after]:.2f}x")


if __name__ == "__main__":
    main()

"""Per-rank time of one causal LSS attention layer: contiguous, zigzag and balanced, interleaved.

A whole-step benchmark shows the slowest rank; this shows every rank's forward and backward of
one ``lss_attention`` call (``[1, L/N, H, D]`` per rank, float32, the fused kernel), so an
imbalance or a rank idling on another's transfer is visible. Each repetition runs the three
variants in turn after a barrier; the first repetition is a warm-up and is not counted.

Usage (the figures of docs/strategies_measured.md, "Balanced causal LSS without moving tokens")::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/bench_lss_ranks.py --seq-len 8192 --reps 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.methods import lss_attention
from dspzoo.core.parallel.methods.ring import zigzag_lengths

VARIANTS = {"lss": {}, "lss_zigzag": {"layout": "zigzag"}, "lss_balanced": {"balanced": True}}


def time_variant(
    name: str, seq_len: int, heads: int, head_dim: int, seed: int
) -> tuple[float, float]:
    """Seconds of this rank's forward and backward of one call of variant ``name``."""
    n, r = dist.get_world_size(), dist.get_rank()
    lengths = zigzag_lengths(seq_len, n) if name == "lss_zigzag" else shard_sizes(seq_len, n)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, lengths[r], heads, head_dim, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dist.barrier()
    start = time.perf_counter()
    out = lss_attention(
        q, k, v, group=dist.group.WORLD, seq_lengths=lengths, causal=True, **VARIANTS[name]
    )
    forward = time.perf_counter() - start
    out.sum().backward()
    return forward, time.perf_counter() - start - forward


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="counted repetitions (after one warm-up)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps + 1):
        for name in VARIANTS:
            t = time_variant(name, args.seq_len, args.heads, args.head_dim, seed=rep)
            if rep:
                times[name].append(t)
    n = dist.get_world_size()
    if dist.get_rank() == 0:
        print(
            f"L {args.seq_len}, SP {n}, {args.heads} heads x {args.head_dim}, median of {args.reps}"
        )
        print("| variant | " + " | ".join(f"rank {i} fwd / bwd s" for i in range(n)) + " |")
        print("|---|" + "---|" * n)
    for name, runs in times.items():
        mine = (statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs))
        every: list[tuple[float, float] | None] = [None] * n
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            cells = " | ".join(f"{f:.3f} / {b:.3f}" for f, b in every)
            print(f"| {name} | {cells} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

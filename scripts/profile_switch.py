"""Where a small ``switch`` spends its time beyond a bare all-to-all: each piece timed apart.

Two gloo ranks (spawned here), a ``[1, T/2, S, C]`` float32 activation switched from sharded on
``T`` to sharded on ``S`` (the shape of ``scripts/bench_comm.py``). Every repetition runs each
piece once behind a barrier, in turn (odd repetitions in reverse order); the table gives the
median wall time (slowest rank) and process CPU time (all threads, larger rank) per piece, and
the mean wall time of a run of calls with no barrier between them (``in a row``: the steady
per-call cost, free of the ranks' skew leaving a barrier, which dominates a single small call):

* ``bare a2a``: ``all_to_all_single`` of a ready buffer into a ready buffer (gloo's floor);
* ``bare shm``: the same ready, contiguous blocks through the group's shared-memory channel,
  own block copied while the peer takes its one (that transport's floor; the gloo figure again
  where the group has no channel);
* ``a2a as switched``: the same bytes as the switch sends them (own block left out, split sizes,
  asynchronous launch then wait);
* ``fresh result`` / ``recycled result``: allocating the result and writing it once (page faults
  on a fresh block; none on a recycled storage);
* ``pack``: the copy of the blocks to send into the send workspace;
* ``own block``: the copy of the rank's own block into the result;
* ``layout`` / ``layout cached``: computing the switch's sizes (``_SwitchMeta.build``) / looking
  them up;
* ``launch``: the exchange on the path the settings pick (shared memory between the processes
  of one host: chunks straight from ``x`` into the result; else pack, all-to-all and own block)
  with a fresh result, no Python around it;
* ``unchecked``: ``switch_agreed`` (launch + the handle, autograd node, guard and trace hooks);
* ``switch``: the checked switch in its steady state (agreement folded into the exchange).

Usage::

    OMP_NUM_THREADS=1 python scripts/profile_switch.py --size-mib 1 --iters 200
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspzoo.core.entry import release_communicators
from dspzoo.core.perf import keep_freed_memory


def _pieces(rank: int, mib: float) -> tuple[dict[str, Callable[[], object]], tuple[int, ...]]:
    from dspzoo.core import switch
    from dspzoo.core.parallel.comm import shm
    from dspzoo.core.parallel.comm.blocks import pack_blocks, result_tensor
    from dspzoo.core.parallel.comm.exchange import (
        _launch,
        _SwitchMeta,
        _unchecked_meta,
        switch_agreed,
    )

    group, n, channels, t_local = dist.group.WORLD, 2, 256, 8
    s = max(n, int(mib * 2**20 / 4) // (t_local * channels) // n * n)
    x = torch.randn(1, t_local, s, channels)
    flat, out = x.reshape(-1).clone(), torch.empty(x.numel())
    half = x.numel() // 2
    splits = [0, half] if rank == 0 else [half, 0]
    remote = torch.empty(half)
    meta = _SwitchMeta.build(x, 1, 2, t_local * n, n, rank)
    keep = range(1, 2) if rank == 0 else range(0, 1)
    result = torch.empty(meta.y_shape)
    own_src = x.narrow(2, rank * (s // 2), s // 2)
    own_dst = result.view(-1)[:half] if rank == 0 else result.view(-1)[half:]

    channel = shm.transfer_channel(group, "cpu")
    blocks, landing = list(flat.view(n, -1)), list(out.view(n, -1))

    def bare_shm() -> None:
        if channel is None:
            dist.all_to_all_single(out, flat, group=group)
            return
        shm.start_blocks(channel, blocks, landing, "bare").wait()

    def a2a_as_switched() -> None:
        dist.all_to_all_single(remote, flat[:half], splits, splits, async_op=True).wait()

    return {
        "bare a2a": lambda: dist.all_to_all_single(out, flat, group=group),
        "bare shm": bare_shm,
        "a2a as switched": a2a_as_switched,
        "fresh result": lambda: torch.empty(meta.y_shape).fill_(0),
        "recycled result": lambda: result_tensor(meta.y_shape, x, group).fill_(0),
        "pack": lambda: pack_blocks(x, 2, meta.dst_sizes, keep=keep, reuse=True, group=group),
        "own block": lambda: own_dst.view(own_src.shape).copy_(own_src),
        "layout": lambda: _SwitchMeta.build(x, 1, 2, t_local * n, n, rank),
        "layout cached": lambda: _unchecked_meta(x, 1, 2, group, t_local * n, None, None, "s"),
        "launch": lambda: _launch(x, meta, group, False),
        "unchecked": lambda: switch_agreed(x, 1, 2, group, src_length=t_local * n),
        "switch": lambda: switch(x, 1, 2, group, src_length=t_local * n),
    }, tuple(x.shape)


def _run(rank: int, mib: float, iters: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    keep_freed_memory()  # as every launch through setup_accelerate does on CPU
    dist.init_process_group("gloo", rank=rank, world_size=2)
    fns, shape = _pieces(rank, mib)
    for fn in fns.values():
        fn()
        fn()
    wall = torch.zeros(iters, len(fns), dtype=torch.float64)
    cpu = torch.zeros_like(wall)
    order = list(enumerate(fns.values()))
    for i in range(iters):
        for j, fn in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[i, j] = time.perf_counter() - start
            cpu[i, j] = time.process_time() - start_cpu
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    in_a_row = _back_to_back(fns, iters)
    if rank == 0:
        print(f"switch pieces, N = 2, x {shape} float32 ({mib:g} MiB), median of {iters}")
        print(f"{'piece':<18} {'wall us':>9} {'cpu us':>9} {'in a row us':>12}")
        walls, cpus = wall.median(0).values.tolist(), cpu.median(0).values.tolist()
        for name, w, c, b in zip(fns, walls, cpus, in_a_row.tolist()):
            print(f"{name:<18} {w * 1e6:9.1f} {c * 1e6:9.1f} {b * 1e6:12.1f}")
        print(
            "wall, cpu: one call behind a barrier (the wall time includes the ranks' skew leaving "
            "it);\nin a row: the mean of a run of calls with no barrier between them (the "
            "steady per-call cost; slowest rank, median of 5 runs)"
        )
    release_communicators()  # also the groups held in reference cycles (else gloo aborts at exit)


def _back_to_back(fns: dict[str, Callable[[], object]], iters: int) -> torch.Tensor:
    """Per piece, the mean wall time (s) of ``iters`` calls in a row with no barrier between
    them; the slowest rank's, median of 5 runs (the pieces in turn, odd runs reversed)."""
    order = list(enumerate(fns.values()))
    runs = torch.zeros(5, len(fns), dtype=torch.float64)
    for i in range(5):
        for j, fn in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            runs[i, j] = (time.perf_counter() - start) / iters
    dist.all_reduce(runs, op=dist.ReduceOp.MAX)
    return runs.median(0).values


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--port", type=int, default=29641)
    args = parser.parse_args()
    mp.spawn(_run, args=(args.size_mib, args.iters, args.port), nprocs=2)


if __name__ == "__main__":
    main()

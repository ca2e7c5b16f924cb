"""CPU benchmark of one scan stage under the three scan methods at SP 2 (gloo).

The same Mamba mixer, weights and input ``[B, T, S, C]``, one stage that scans ``s``:

* ``dsp``: the DSP plan shards ``t``; each rank scans its ``T/N`` lines of ``S`` whole, with no
  communication inside the stage (the axial case);
* ``state_passing``: ``s`` sharded; each rank scans its segment of every line, the conv halo by
  p2p, the segment summaries in one all-gather, a correction;
* ``head_a2a``: ``s`` sharded; an all-to-all to head (channel) shards after the conv, whole
  lines per head, and back.

Every rank does the same FLOPs up to the methods' extras. Per step (forward + backward of the
stage, entry split and exit gather included, as in a model): the median wall time over
interleaved rounds (every method once per round), its ratio to ``dsp``, the bytes this rank
sent (traced, exit gather excluded) and the activation memory saved for backward
(:class:`~dspzoo.core.parallel.trace.SavedTensorMeter`)::

    python scripts/bench_scan_methods.py                          # Mamba-2, S = 4096
    python scripts/bench_scan_methods.py --mixer mamba1 --length 2048 --rounds 5

Times on a shared CPU are noisy; the ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from dspzoo.core.layers.mamba import (
    Mamba1Config,
    Mamba1Mixer,
    Mamba2Config,
    Mamba2Mixer,
    scan_along,
)
from dspzoo.core.parallel import context
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.plan import Stage
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.strategies import Embedded
from dspzoo.core.parallel.trace import SavedTensorMeter, format_bytes, trace_comm
from dspzoo.core.testing import run_distributed

METHODS = ("dsp", "state_passing", "head_a2a")
NAMES = ("t", "s")
STAGES = (Stage("scan", ("s",), op="scan"),)


def make_mixer(kind: str, hidden: int) -> nn.Module:
    """Mamba-1 (state 16) or Mamba-2 (heads of 64, state 64, one group, chunk 256)."""
    if kind == "mamba1":
        return Mamba1Mixer(Mamba1Config(hidden_size=hidden, state_size=16))
    inner = 2 * hidden
    return Mamba2Mixer(
        Mamba2Config(
            hidden_size=hidden, num_heads=inner // 64, head_dim=64, state_size=64, chunk_size=256
        )
    )


class ScanStage(nn.Module):
    """One residual scan stage over ``s`` of a ``[B, T, S, C]`` activation."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.mixer = make_mixer(kind, hidden)

    def forward(self, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
        act = sp.enter(x, NAMES, STAGES)
        with sp.region(act) as region:
            h = context.stage("scan", act.tensor)
            act = region.seq(h + scan_along(self.mixer, h, "s"))
        return sp.exit(act)


def runtime(mesh: SPMesh, method: str) -> SeqParallel:
    """DSP's plan, or ``s`` sharded with the scan method."""
    return SeqParallel(mesh, "dsp" if method == "dsp" else Embedded(method, "s"))


def _step(model: nn.Module, x: torch.Tensor, sp: SeqParallel, group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    out = model(x, sp)
    out.square().mean().backward()
    dist.barrier(group=group)
    return time.perf_counter() - start


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    mesh = SPMesh(world, rank, 1, world, 0, rank, sp_group=dist.group.WORLD)
    torch.manual_seed(0)
    model = ScanStage(args.mixer, args.hidden)
    x = torch.randn(args.batch, args.lines, args.length, args.hidden)
    sps = {m: runtime(mesh, m) for m in METHODS}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    sent, saved = {}, {}
    for m in METHODS:  # warm-up, bytes and memory (one step each)
        with trace_comm() as tracer, SavedTensorMeter(exclude=model.parameters()) as meter:
            out = model(x, sps[m])
        out.square().mean().backward()
        sent[m] = sum(r.bytes_sent for r in tracer.records if not r.region.startswith("exit"))
        saved[m] = meter.bytes
        model.zero_grad(set_to_none=True)
    for _ in range(args.rounds):
        for m in METHODS:
            times[m].append(_step(model, x, sps[m], dist.group.WORLD))
            model.zero_grad(set_to_none=True)
    return {"times": times, "sent": sent, "saved": saved}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixer", choices=("mamba1", "mamba2"), default="mamba2")
    parser.add_argument("--length", type=int, default=4096, help="S, the scanned dim")
    parser.add_argument("--lines", type=int, default=2, help="T, the other dim")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2, help="SP size (gloo processes)")
    args = parser.parse_args(argv)
    command = "python scripts/bench_scan_methods.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    results = run_distributed(_worker, args.world, args, timeout=3600)
    print(f"# {command}")
    print(
        f"# {args.mixer} hidden {args.hidden}, x [B={args.batch}, T={args.lines}, "
        f"S={args.length}, C={args.hidden}], scan over s, SP {args.world}, "
        f"{args.rounds} interleaved rounds, torch {torch.__version__}, {args.threads} thread(s)/rank"
    )
    base = None
    print(f"{'method':<14} {'step ms':>9} {'/ dsp':>7} {'sent/rank':>11} {'saved/rank':>11}")
    for m in METHODS:
        per_round = [max(r["times"][m][i] for r in results) for i in range(args.rounds)]
        median = statistics.median(per_round)
        base = median if base is None else base
        sent = max(r["sent"][m] for r in results)
        saved = max(r["saved"][m] for r in results)
        print(
            f"{m:<14} {median * 1e3:>9.1f} {median / base:>7.2f} {format_bytes(sent):>11} "
            f"{format_bytes(saved):>11}"
        )


if __name__ == "__main__":
    main()

"""Video DiT under DSP at every SP size the launch allows, in one run, on the same weights.

    accelerate launch --multi_gpu --num_processes 4 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_video.py --model stdit-mini

For each SP size dividing the number of processes (SP 1 = pure data parallel) it runs a
training step (forward + backward, fp32) on the same sample and reports per rank: activation
memory saved for backward (exact), all-to-all bytes per layer traced vs the formula
2·(M/N)·(N−1)/N·itemsize, and the step time. Memory and bytes are exact on any machine;
times on a 2-core CPU are only indicative.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SavedTensorMeter, SeqParallel, build_mesh, sp_mse, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.parallel.trace import format_bytes
from dspzoo.zoo import create_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="stdit-mini")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--latent", type=int, default=16, help="latent H = W")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    accelerator, world_mesh, _ = setup_accelerate(sp_size=1)
    world = world_mesh.world_size
    torch.manual_seed(0)
    model = create_model(args.model, cond_dim=0)
    x = torch.randn(1, model.config.in_channels, args.frames, args.latent, args.latent)
    target = torch.randn_like(x)
    t = torch.tensor([500.0])
    tokens = args.frames * (args.latent // 2) ** 2
    m = tokens * model.config.hidden
    rows = []
    for sp_size in [d for d in range(1, world + 1) if world % d == 0]:
        mesh = build_mesh(sp_size)
        sp = SeqParallel(mesh)
        times = []
        for i in range(args.iters + 1):
            model.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            with trace_comm() as tracer:
                with SavedTensorMeter(model.parameters()) as meter:
                    out = model(x, t, sp=sp, gather_output=False)
                    loss = sp_mse(
                        out.tensor, sp.shard_like(model.patchify_target(target), out), sp.group
                    )
                loss.backward()
            if i:
                times.append(time.perf_counter() - start)
        per_layer = tracer.total_bytes("all_to_all", "forward", "block1")
        formula = 2 * (m / sp_size) * (sp_size - 1) / sp_size * 4
        stats = torch.tensor(
            [meter.bytes, per_layer, statistics.median(times)], dtype=torch.float64
        )
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows.append((sp_size, *stats.tolist(), formula))
    if world_mesh.is_main:
        base_mem, base_time = rows[0][1], rows[0][3]
        print(
            f"\n{args.model}: 1 sample of T={args.frames}, latent {args.latent}×{args.latent} "
            f"({tokens} tokens, hidden {model.config.hidden}); {world} processes; worst rank shown"
        )
        print(
            f"{'SP':>3} {'act. memory/rank':>17} {'vs SP1':>7} {'1/N':>6} {'a2a bytes/layer':>16} {'formula':>12} "
            f"{'step s':>8} {'speed-up':>9}"
        )
        for sp_size, mem, layer_bytes, step, formula in rows:
            print(
                f"{sp_size:>3} {format_bytes(mem):>17} {mem / base_mem:7.3f} {1 / sp_size:6.3f} "
                f"{format_bytes(layer_bytes):>16} {format_bytes(formula):>12} {step:8.3f} {base_time / step:8.2f}x"
            )
        print(
            f"\nreproduce: accelerate launch --multi_gpu --num_processes {world} --num_machines 1 --mixed_precision no --dynamo_backend no scripts/bench_video.py "
            f"--model {args.model} --frames {args.frames} --latent {args.latent} --iters {args.iters}"
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "bench_video.py"))

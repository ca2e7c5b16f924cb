"""A 2-process DSP demo: plan, switches, bytes moved, memory, and a check against 1 process.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/dsp_demo.py

(the last three flags are Accelerate's defaults, passed so that it does not warn about them).

Runs one forward + backward of a small 2-D (t, s) axial transformer with its activations
sharded over the SP group, prints the switch plan, every collective with the bytes it sent
(per region), the activation memory saved for backward per rank, and confirms that the loss
and gradients equal the single-process computation.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dspzoo.core import SavedTensorMeter, single_process_mesh, sp_mse, sp_report, trace_comm
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.trace import format_bytes
from dspzoo.domains.toy.model import STAGES, Toy2DConfig, Toy2DTransformer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sp", type=int, default=None, help="SP size (default: all processes)")
    parser.add_argument("--frames", type=int, default=8, help="T")
    parser.add_argument(
        "--tokens", type=int, default=63, help="S (spatial tokens); 63 is deliberately uneven"
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args()

    import torch.distributed as dist

    world = (
        dist.get_world_size()
        if dist.is_initialized()
        else int(__import__("os").environ.get("WORLD_SIZE", 1))
    )
    accelerator, mesh, sp = setup_accelerate(sp_size=args.sp or world, seed=0)
    cfg = Toy2DConfig(
        in_channels=4,
        hidden=args.hidden,
        heads=4,
        depth=args.depth,
        max_t=args.frames,
        max_s=args.tokens,
    )
    torch.manual_seed(0)
    model = Toy2DTransformer(cfg)
    reference = Toy2DTransformer(cfg)
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model) if mesh.world_size > 1 else model

    g = torch.Generator().manual_seed(100 + mesh.dp_rank)
    x = torch.randn(1, args.frames, args.tokens, cfg.in_channels, generator=g)
    target = torch.randn(1, args.frames, args.tokens, cfg.in_channels, generator=g)

    plan = sp.plan(("t", "s"), (args.frames, args.tokens), STAGES)
    with trace_comm() as tracer:
        with SavedTensorMeter(model.parameters()) as meter:
            out = ddp(x, sp, gather_output=False)
            loss = sp_mse(out.tensor, sp.shard_like(target, out), sp.group)
        loss.backward()

    # single-process reference on every rank (cheap at this size)
    with SavedTensorMeter(reference.parameters()) as ref_meter:
        ref_loss = torch.nn.functional.mse_loss(
            reference(x, SeqParallel(single_process_mesh())), target
        )
    ref_loss.backward()
    full_loss = sp_report(loss, sp.group)
    worst = max(
        (p.grad - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    if mesh.dp_size > 1:
        worst = float("nan")  # DDP averaged over different DP samples: not comparable per rank

    m = x.shape[0] * args.frames * args.tokens * cfg.hidden
    formula = plan.switch_bytes_per_period(m, 4)
    lines = [
        f"\n[rank {mesh.rank}] {mesh}",
        f"  loss {full_loss:.6f} (single process {ref_loss.item():.6f}); max |grad diff| {worst:.2e}",
        f"  activation memory saved for backward: {format_bytes(meter.bytes)} "
        f"(single process {format_bytes(ref_meter.bytes)}, ratio {meter.bytes / ref_meter.bytes:.2f})",
        f"  per-layer switch bytes: traced {format_bytes(tracer.total_bytes('all_to_all', 'forward', 'block1'))}, "
        f"formula 2·(M/N)·(N−1)/N·4 = {format_bytes(formula)}",
    ]
    if mesh.is_main:
        print(plan)
        print("\ncollectives on rank 0 (forward and backward):")
        print(tracer.table())
    accelerator.wait_for_everyone()
    for r in range(mesh.world_size):
        if r == mesh.rank:
            print("\n".join(lines), flush=True)
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "dsp_demo.py"))

r"""Per-rank memory of training a video model with and without ``--fsdp`` (docs/training.md).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no scripts/fsdp_memory.py --model stdit-small --out fsdp_memory.json

Every process of the launch trains ``--steps`` steps of the video Trainer twice — under DDP,
then under ``--fsdp`` (dp × sp = ``--sp`` per group) — and measures, per rank and per run, the
model state it holds after the last step: its parameters (a sharded parameter's local shard),
their gradients during backward (the same size) and the optimizer's state (Adam's moments,
local shards), in bytes; plus the activation memory of the first step (the Trainer's meter).
Model state is the part ``--fsdp`` divides by the world size. Peak RSS is printed as well;
it includes the Python interpreter and torch and grows monotonically across the two runs, so
the exact tensor accounting above is the comparison. The main process writes ``--out`` (JSON)
and prints one line per run; the cost model's figure for the same model at the same world
size (``model_state_bytes``, fp32 weights, gradients and Adam moments) sits beside it.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def model_state(trainer: Any) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients (as large as the parameters during
    backward) and optimizer state."""
    params = _bytes(trainer.model.parameters())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters": params,
        "gradients": params,
        "optimizer": _bytes(states),
        "total": 2 * params + _bytes(states),
    }


def run(args: argparse.Namespace, fsdp: bool) -> dict[str, Any]:
    from dspzoo.core.train import Trainer
    from dspzoo.domains.video.training import VideoTask, VideoTrainConfig

    cfg = VideoTrainConfig(
        model=args.model,
        sp=args.sp,
        steps=args.steps,
        global_batch=args.global_batch,
        frames=args.frames,
        size=args.size,
        num_samples=64,
        warmup=1,
        log_every=args.steps,
        save_every=0,
        ema=0.0,
        fsdp=fsdp,
        output_dir=str(Path(args.work) / ("fsdp" if fsdp else "ddp")),
    )
    trainer = Trainer(VideoTask(cfg))
    result = trainer.run()
    return {
        **model_state(trainer),
        "activation": result["activation_bytes"],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "losses": result["losses"],
        "gradients_by": trainer.sync.method,
        "parameter_count": sum(p.numel() for p in trainer.model.parameters()),  # full sizes
    }


def main(argv: list[str] | None = None) -> dict | None:
    import torch.distributed as dist

    from dspzoo.core.costmodel import model_state_bytes
    from dspzoo.zoo import count_parameters, create_model

    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="stdit-small")
    parser.add_argument("--sp", type=int, default=1, help="ranks per SP group (default: 1)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--compare", default="stdit-720M", help="model for the cost-model row")
    parser.add_argument("--work", default="outputs/fsdp_memory")
    parser.add_argument("--out", default="outputs/fsdp_memory.json")
    args = parser.parse_args(argv)
    runs = {"ddp": run(args, fsdp=False), "fsdp": run(args, fsdp=True)}
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank: list[Any] = [runs]
    if world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, runs)
    if dist.is_initialized() and dist.get_rank() > 0:
        return None

    def predicted(name: str, zero: int) -> float:
        if name == args.model:  # as built for the data (channels, frames, sizes)
            params = runs["ddp"]["parameter_count"]
        else:
            params = count_parameters(create_model(name))
        return model_state_bytes(
            params, param_itemsize=4, grad_itemsize=4, optimizer_bytes=8, shard=world, zero=zero
        )

    report = {
        "model": args.model,
        "world": world,
        "sp": args.sp,
        "per_rank": per_rank,
        "cost_model": {
            name: {"ddp": predicted(name, 0), "fsdp": predicted(name, 3)}
            for name in (args.model, args.compare)
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    mib = 2**20
    for mode in ("ddp", "fsdp"):
        worst = max(r[mode]["total"] for r in per_rank)
        print(
            f"{args.model} {mode}: model state/rank {worst / mib:.1f} MiB (cost model "
            f"{report['cost_model'][args.model][mode] / mib:.1f} MiB), activations/rank "
            f"{max(r[mode]['activation'] for r in per_rank) / mib:.1f} MiB, peak RSS "
            f"{max(r[mode]['peak_rss'] for r in per_rank) / mib:.0f} MiB"
        )
    for mode in ("ddp", "fsdp"):
        print(
            f"{args.compare} {mode} (cost model): model state/rank "
            f"{report['cost_model'][args.compare][mode] / 2**30:.2f} GiB at {world} ranks"
        )
    return report


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "fsdp_memory.py"))

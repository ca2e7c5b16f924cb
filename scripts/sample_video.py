r"""Sample videos from a trained video DiT with DSP across the launched processes.

    dspzoo sample stdit-mini-shapes --out shapes.gif                 # a shipped name, 1 process
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        -m dspzoo sample stdit-mini-shapes --out shapes.gif   # or a save_pretrained folder

The latents stay sharded over the SP group for every denoising step and are gathered once at
the end; rank 0 writes a GIF (or MP4) grid with one row per class label (in label order) of
--per-class clips each, and a PNG beside it: the frames of the first clip of every class, one
row per class. The command line of :func:`dspzoo.zoo.inference.sample_video` (the Python API).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.domains.video.io import save_frame_strip_png, video_grid, write_video
from dspzoo.zoo import inference


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name "
        "(dspzoo list --pretrained)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output .gif or .mp4 (default: samples.gif beside a folder's model, "
        "outputs/<name>/samples.gif for a shipped name; an existing file is replaced)",
    )
    parser.add_argument("--sp", type=int, default=None, help="SP size (default: all processes)")
    parser.add_argument(
        "--sp-strategy",
        default="dsp",
        choices=sorted(STRATEGIES),
        help="sequence-parallel strategy (default: dsp)",
    )
    parser.add_argument("--steps", type=int, default=30, help="Euler steps (default: 30)")
    parser.add_argument(
        "--guidance",
        type=float,
        default=3.0,
        help="classifier-free guidance scale (default: 3.0, as docs/video.md's samples; 1: none)",
    )
    parser.add_argument(
        "--per-class", type=int, default=2, help="clips per class label (default: 2)"
    )
    parser.add_argument(
        "--frames", type=int, default=None, help="frames (default: those saved with the model)"
    )
    parser.add_argument(
        "--size", type=int, default=None, help="pixel size (default: saved with the model)"
    )
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    parser.add_argument(
        "--upscale", type=int, default=4, help="nearest-neighbour upscaling of the output"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.per_class < 1 or args.upscale < 1:
        parser.error("--steps, --per-class and --upscale must be >= 1")

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    accelerator, mesh, sp = setup_accelerate(
        sp_size=args.sp or world, seed=args.seed, strategy=args.sp_strategy
    )
    model = inference.load(args.model_dir, inference.VIDEO_FAMILIES, accelerator.device)
    result = inference.sample_video(
        model,
        per_class=args.per_class,
        steps=args.steps,
        guidance=args.guidance,
        frames=args.frames,
        size=args.size,
        seed=args.seed,
        sp=sp,
        progress=mesh.is_main,
    )
    latency = torch.tensor([result.seconds], device=accelerator.device)  # NCCL: CUDA tensors
    if dist.is_initialized():
        dist.all_reduce(latency, op=dist.ReduceOp.MAX)
    if mesh.is_main:
        video = result.video
        grid = video_grid(video, nrow=args.per_class)  # one row per class label
        default = inference.default_output_folder(args.model_dir) / "samples.gif"
        out = Path(args.out) if args.out else default
        write_video(grid, out, fps=6, upscale=args.upscale)
        strip = save_frame_strip_png(
            video_grid(video[:: args.per_class], nrow=1),
            out.with_suffix(".png"),
            upscale=args.upscale,
        )
        _, _, frames, height, width = video.shape
        print(
            f"sampled {len(video)} clips of {frames}×{height}×{width} with {args.steps} steps on "
            f"{mesh.sp_size} SP rank(s) on {accelerator.device.type}: {float(latency):.2f} s "
            f"({float(latency) / args.steps * 1000:.1f} ms/step) -> {out} and {strip}"
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "sample_video.py"))

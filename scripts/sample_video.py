"""Sample videos from a trained video DiT with DSP across the launched processes.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/sample_video.py \
        --model-dir outputs/stdit-tiny/final --out outputs/stdit-tiny/samples.gif

The latents stay sharded over the SP group for every denoising step and are gathered once at
the end; rank 0 decodes them and writes a GIF (or MP4) grid with one clip per class label.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import dspzoo.domains.video  # noqa: F401  (registers the families)
from dspzoo.core.accelerate import setup_accelerate
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.domains.video.codec import PixelUnshuffleCodec
from dspzoo.domains.video.io import save_frame_strip_png, video_grid, write_video
from dspzoo.domains.video.sampling import sample_video
from dspzoo.zoo import from_pretrained, load_config, load_extra


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name "
        "(dspzoo list --pretrained)",
    )
    parser.add_argument(
        "--out", default=None, help="output .gif or .mp4 (default: <model-dir>/../samples.gif)"
    )
    parser.add_argument("--sp", type=int, default=None, help="SP size (default: all processes)")
    parser.add_argument(
        "--sp-strategy",
        default="dsp",
        choices=sorted(STRATEGIES),
        help="sequence-parallel strategy (default: dsp)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--guidance", type=float, default=2.0)
    parser.add_argument("--per-class", type=int, default=2, help="clips per class label")
    parser.add_argument(
        "--frames", type=int, default=None, help="frames (default: those saved with the model)"
    )
    parser.add_argument(
        "--size", type=int, default=None, help="pixel size (default: saved with the model)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--upscale", type=int, default=4, help="nearest-neighbour upscaling of the output"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.per_class < 1 or args.upscale < 1:
        parser.error("--steps, --per-class and --upscale must be >= 1")

    import torch.distributed as dist

    world = (
        dist.get_world_size()
        if dist.is_initialized()
        else int(__import__("os").environ.get("WORLD_SIZE", 1))
    )
    accelerator, mesh, sp = setup_accelerate(
        sp_size=args.sp or world, seed=args.seed, strategy=args.sp_strategy
    )
    model_dir = Path(args.model_dir)
    family, _ = load_config(model_dir)
    if family not in ("stdit", "latte"):
        raise SystemExit(f"{model_dir} holds a {family!r} model, not a video model (stdit, latte)")
    settings = load_extra(model_dir).get("sampling", {})
    if not settings and (args.frames is None or args.size is None):
        raise SystemExit(
            f"{model_dir} holds no sampling settings (frames, size, codec; train_video.py saves "
            f"them with the final model): pass --frames and --size"
        )
    frames = args.frames or settings["frames"]
    size = args.size or settings["size"]
    codec = PixelUnshuffleCodec(settings.get("codec_factor", 2))
    model = from_pretrained(model_dir).to(accelerator.device).eval()  # family checked above
    classes = max(1, model.config.num_classes)
    labels = torch.arange(classes).repeat_interleave(args.per_class)
    shape = (
        len(labels),
        model.config.in_channels,
        frames,
        size // codec.factor,
        size // codec.factor,
    )

    result = sample_video(
        model,
        sp,
        shape,
        steps=args.steps,
        labels=labels if model.config.num_classes else None,
        guidance=args.guidance,
        seed=args.seed,
        progress=mesh.is_main,
    )
    latency = torch.tensor([result.seconds])
    if dist.is_initialized():
        dist.all_reduce(latency, op=dist.ReduceOp.MAX)
    if mesh.is_main:
        video = codec.decode(result.latents).clamp(-1, 1)
        grid = video_grid(video, nrow=args.per_class * min(classes, 4))
        # a shipped model (given by name) has no output folder of its own
        default = model_dir.parent if model_dir.is_dir() else Path("outputs") / model_dir.name
        out = Path(args.out) if args.out else default / "samples.gif"
        write_video(grid, out, fps=6, upscale=args.upscale)
        strip = save_frame_strip_png(
            video_grid(video[:: args.per_class], nrow=1),
            out.with_suffix(".png"),
            upscale=args.upscale,
        )
        print(
            f"sampled {len(labels)} clips of {frames}×{size}×{size} with {args.steps} steps on {mesh.sp_size} SP rank(s): "
            f"{float(latency):.2f} s ({float(latency) / args.steps * 1000:.1f} ms/step) -> {out} and {strip}"
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "sample_video.py"))

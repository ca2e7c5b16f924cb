"""``dspzoo plan``: FLOPs, bytes, memory and predicted step time per strategy and SP size.

dspzoo plan stdit-720M --frames 128 --size 512 --batch 1 --sp 1,2,4,8 --cluster h100-nvlink-ib
dspzoo plan bytelm-lss-12l --seq-len 50000 --sp 8,16 --cluster v100-summit

Video ``--frames`` are latent frames and ``--size`` the video's pixel size (divided by
``--vae-stride``, 8 by default; ``--latent`` gives the latent size directly). ``--inference``
predicts a forward pass only (``--steps`` of them, e.g. sampling steps).
"""

from __future__ import annotations

import argparse
import sys

from dspzoo.core.costmodel import (
    CLUSTERS,
    DEFAULT_STRATEGIES,
    format_table,
    predict_table,
    recommend,
    workload_for,
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``plan`` arguments (on ``parser``, e.g. a ``dspzoo`` subparser)."""
    p = parser or argparse.ArgumentParser(prog="dspzoo plan", description=__doc__.split("\n")[0])
    p.add_argument("model", help="zoo model, e.g. stdit-720M, latte-3B, bytelm-lss-12l")
    p.add_argument("--frames", type=int, help="video: latent frames")
    p.add_argument("--size", type=str, help="video: pixel size H or HxW")
    p.add_argument("--latent", type=str, help="video: latent size H or HxW (instead of --size)")
    p.add_argument("--vae-stride", type=int, default=8, help="pixels per latent (default 8)")
    p.add_argument("--context", type=int, default=0, help="video: conditioning tokens")
    p.add_argument("--seq-len", type=int, help="text: bytes per sequence")
    p.add_argument("--batch", type=int, default=1, help="samples per SP group")
    p.add_argument("--sp", type=str, default="1,2,4,8", help="SP sizes, comma-separated")
    p.add_argument(
        "--strategies",
        type=str,
        default=",".join(DEFAULT_STRATEGIES),
        help="strategies to compare, comma-separated (default: all)",
    )
    p.add_argument("--cluster", default="h100-nvlink-ib", choices=CLUSTERS)
    p.add_argument("--dtype-bytes", type=int, default=2, help="activation bytes (bf16: 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel groups (ZeRO sharding)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--recompute", action="store_true", help="activation checkpointing")
    p.add_argument("--inference", action="store_true", help="forward only")
    p.add_argument("--steps", type=int, default=1, help="forward passes per prediction")
    return p


def _hw(text: str, scale: int = 1) -> tuple[int, int]:
    h, _, w = text.lower().partition("x")
    return int(h) // scale, int(w or h) // scale


def run(args: argparse.Namespace) -> int:
    """Print the prediction table; bad input raises ``ValueError``/``KeyError`` with the reason."""
    from .registry import get_config, resolve_name

    config = get_config(resolve_name(args.model))  # clear error for unknown names
    is_text = hasattr(config, "max_len") or not hasattr(config, "patch")
    if is_text and args.seq_len is None:
        raise ValueError(f"{args.model} is a sequence model: give --seq-len")
    if not is_text and args.seq_len is not None:
        raise ValueError(f"{args.model} is a video model: give --frames and --size, not --seq-len")
    if args.size is not None and min(_hw(args.size)) < args.vae_stride:
        raise ValueError(
            f"--size {args.size} is smaller than one latent pixel (--vae-stride {args.vae_stride})"
        )
    if args.seq_len is not None:
        wl = workload_for(
            args.model, batch=args.batch, seq_len=args.seq_len, itemsize=args.dtype_bytes
        )
    else:
        if args.frames is None or (args.size is None and args.latent is None):
            raise ValueError("a video model needs --frames and --size (or --latent)")
        spatial = _hw(args.latent) if args.latent else _hw(args.size, args.vae_stride)
        wl = workload_for(
            args.model,
            batch=args.batch,
            frames=args.frames,
            spatial=spatial,
            context=args.context,
            itemsize=args.dtype_bytes,
        )
    sizes = [int(s) for s in args.sp.split(",") if s.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    rows = predict_table(
        wl,
        strategies,
        sizes,
        args.cluster,
        dp=args.dp,
        zero=args.zero,
        recompute=args.recompute,
        training=not args.inference,
    )
    if args.steps != 1:
        rows = [
            p.__class__(
                **{
                    **p.__dict__,
                    "flops": p.flops * args.steps,
                    "bytes": p.bytes * args.steps,
                    "compute_s": p.compute_s * args.steps,
                    "comm_s": p.comm_s * args.steps,
                    "step_s": p.step_s * args.steps,
                }
            )
            for p in rows
        ]
    dims = ", ".join(f"{d}={n}" for d, n in zip(wl.dims, wl.lengths))
    what = "inference" if args.inference else "training step"
    print(
        f"{wl.name}: {wl.params / 1e6:.0f}M parameters, batch {wl.batch}, tokens ({dims}), "
        f"{what} x{args.steps} on {args.cluster}"
    )
    print(format_table(rows, recommend(rows)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))


if __name__ == "__main__":
    sys.exit(main())

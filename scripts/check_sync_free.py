"""Check that a training step makes no host synchronisation on CUDA (DESIGN.md: the hot path
is GPU-first): the ``stdit-mini`` model's forward, loss and backward at SP 1, twice, the second
under ``torch.cuda.set_sync_debug_mode("error")``.

    python scripts/check_sync_free.py [--frames 4] [--latent 16] [--batch 2]

The first step warms up (kernel selection, allocator, lazily built tables may read the device
once); the second must not synchronise anywhere. A synchronising op (``.item()``, ``.tolist()``,
``nonzero``, a device-to-host copy, a data-dependent shape, ...) makes PyTorch raise at that
op: the script prints its message and the dspzoo line that called it, then exits 1. Status 0
says "sync-free"; without a CUDA device it prints one line and exits 2. Run by
``scripts/gpu_checks.sh`` as its ``sync_free`` step.
"""

from __future__ import annotations

import argparse
import sys
import traceback


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="check_sync_free.py", allow_abbrev=False, description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--model", default="stdit-mini", help="a video model (default stdit-mini)")
    parser.add_argument("--frames", type=int, default=4, help="latent frames (default 4)")
    parser.add_argument("--latent", type=int, default=16, help="latent size (default 16)")
    parser.add_argument("--batch", type=int, default=2, help="samples per step (default 2)")
    return parser


def _caller(tb: traceback.StackSummary) -> str:
    """The innermost frame of dspzoo's own code (the line that asked for the sync)."""
    ours = [f for f in tb if "/dspzoo/" in f.filename and "check_sync_free" not in f.filename]
    frame = (ours or list(tb))[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from dspzoo.core.errors import UsageError

    if not torch.cuda.is_available():
        raise UsageError(
            f"no CUDA device (torch {torch.__version__}): this check runs a step on a GPU"
        )
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.runner import build_parser as bench_parser
    from dspzoo.core.parallel.mesh import single_process_mesh
    from dspzoo.core.parallel.runtime import SeqParallel

    bench_args = bench_parser().parse_args(
        ["--model", args.model, "--frames", str(args.frames), "--latent", str(args.latent)]
    )
    case = build_case(bench_args, args.batch).to("cuda")
    sp = SeqParallel(single_process_mesh(), "dsp")
    model = case.model.train()
    for attempt in ("warm-up", "checked"):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if attempt == "checked":
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss, _ = case.step(model, sp, case.inputs)
            loss.backward()
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            summary = traceback.extract_tb(exc.__traceback__)
            print(
                f"check_sync_free.py: the {attempt} step synchronised with the host: "
                f"{str(exc).splitlines()[0]} at {_caller(summary)}",
                file=sys.stderr,
            )
            return 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(
        f"check_sync_free.py: {args.model} forward + loss + backward at SP 1 (batch "
        f"{args.batch}, {args.frames} frames of {args.latent}x{args.latent} latents) made no "
        f"host synchronisation; loss {loss.item():.4f}"
    )
    return 0


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "check_sync_free.py"))

r"""Continue a prompt with a trained byte-level language model (one process, KV cache).

    python scripts/generate_text.py --model-dir outputs/bytelm-small/final --prompt "def " --max-new 200

Prints the prompt and its continuation (bytes decoded as UTF-8, undecodable ones replaced).
Sampling is reproducible: the draws come from a generator seeded with --seed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import dspzoo.domains.text  # noqa: F401  (registers the bytelm family)
from dspzoo.zoo import from_pretrained, load_extra


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name "
        "(dspzoo list --pretrained)",
    )
    parser.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    parser.add_argument("--max-new", type=int, default=200, help="bytes to generate (default: 200)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0: always the likeliest byte (default: 0.8)"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=40,
        help="sample among the k likeliest bytes, 0: all (default: 40)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sampling draws (default: 0)"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    return parser


def main(argv: list[str] | None = None) -> str:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new < 0 or args.temperature < 0 or args.top_k < 0 or not args.prompt:
        parser.error("need a non-empty --prompt and --max-new, --temperature, --top-k >= 0")
    try:
        model = from_pretrained(args.model_dir, expected_family="bytelm")
    except (FileNotFoundError, ValueError) as exc:  # CheckpointMismatchError is a ValueError
        parser.error(str(exc))
    model = model.to(args.device).eval()
    prompt = args.prompt.encode("utf-8")
    trained = load_extra(args.model_dir).get("training", {}).get("seq_len")
    if trained and len(prompt) + args.max_new > trained:
        print(
            f"note: generating {len(prompt) + args.max_new} bytes, beyond the {trained}-byte "
            f"windows the model was trained on",
            file=sys.stderr,
        )
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    new = model.generate(prompt, args.max_new, args.temperature, args.top_k or None, generator)
    seconds = time.perf_counter() - start
    text = (prompt + new).decode("utf-8", errors="replace")
    print(text)
    print(
        f"[{len(new)} bytes in {seconds:.2f} s, {len(new) / max(seconds, 1e-9):.0f} bytes/s]",
        file=sys.stderr,
    )
    return text


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "generate_text.py"))

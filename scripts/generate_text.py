r"""Continue a prompt with a trained byte-level language model: a bytelm (one process, KV
cache) or a Mamba LM (mambalm, mamba2lm, hybridlm: recurrent state, and KV cache for a
hybrid's attention layers).

    dspzoo generate bytelm-tiny-stdlib --prompt "def " --max-new 200      # a shipped name
    dspzoo generate outputs/bytelm-small/final --prompt "def "            # or a folder

The command line of :func:`dspzoo.zoo.inference.generate_text` (the Python API).
Prints the prompt and its continuation (bytes decoded as UTF-8, undecodable ones replaced).
Sampling is reproducible: the draws come from a generator seeded with --seed.
"""

from __future__ import annotations

import argparse
import sys

from dspzoo.core.argparser import CommandParser
from dspzoo.zoo import inference
from dspzoo.zoo.pretrained import check_device


def build_parser() -> argparse.ArgumentParser:
    """The flags (run as ``dspzoo generate <model or folder>``, the parser names the model
    positionally and leaves ``--model-dir`` out: :class:`~dspzoo.core.argparser.CommandParser`)."""
    parser = CommandParser(
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
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    return parser


def main(argv: list[str] | None = None) -> str:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = check_device(args.device, flag="--device")  # one line, not a traceback
        loaded = inference.load(args.model_dir, inference.TEXT_FAMILIES, device)
        result = inference.generate_text(
            loaded, args.prompt, args.max_new, args.temperature, args.top_k, args.seed
        )
    except (FileNotFoundError, ValueError) as exc:  # CheckpointMismatchError is a ValueError
        parser.error(str(exc))
    if result.beyond_training:
        print(
            f"note: generated {len(result.prompt) + len(result.new)} bytes, beyond the "
            f"{result.trained_length}-byte windows the model was trained on",
            file=sys.stderr,
        )
    print(result.text, flush=True)  # before the stderr summary, also when both share a pipe
    print(
        f"[{len(result.new)} bytes in {result.seconds:.2f} s, "
        f"{len(result.new) / max(result.seconds, 1e-9):.0f} bytes/s]",
        file=sys.stderr,
    )
    return result.text


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "generate_text.py"))

r"""Train a byte-level language model with sequence parallelism (the LSS enwik8 setting).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_text.py --sp 2 \
        --model bytelm-small --seq-len 512 --steps 1000

--data stdlib (the default) trains on the Python standard library's own sources, built into
one byte file and cached at first use; --data /path/to/enwik8 trains on any raw byte file.
Losses are in bits per byte. Checkpoints go to <output-dir>/checkpoints/step_N (written aside,
fsynced, swapped in; the newest --keep-checkpoints are kept), the final model to
<output-dir>/final, the loss histories to <output-dir>/losses.json. The run is the same at any
dp × sp layout with the same --global-batch, and --resume latest continues it exactly, at any
layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

from dspzoo.domains.text.training import TextTrainConfig, train

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _boolean(text: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off`` or ``1/0`` (any case)."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`TextTrainConfig` field, with its description and choices."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(TextTrainConfig)
    for f in dataclasses.fields(TextTrainConfig):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        choices = f.metadata.get("choices")
        default = "optional" if f.default is None else f"default: {f.default}"
        if f.name == "output_dir":
            default = "default: outputs/<model>"
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=_boolean if base is bool else base,
            default=f.default,
            choices=choices,
            metavar="{true,false}" if base is bool else (None if choices else f.name.upper()),
            help=f"{f.metadata.get('help', '')} ({default})",
        )
    return parser


def parse_args(argv: list[str] | None = None) -> TextTrainConfig:
    """Build a validated :class:`TextTrainConfig` from ``--field-name value`` flags."""
    parser = build_parser()
    cfg = TextTrainConfig(**vars(parser.parse_args(argv)))
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    cfg = parse_args()
    result = train(cfg)
    if result["is_main"] and result["losses"]:
        logging.getLogger("dspzoo.text.train").info(
            "session bits/byte: first %.4f, last %.4f; output in %s",
            result["losses"][0],
            result["losses"][-1],
            result["output_dir"],
        )


if __name__ == "__main__":
    main()

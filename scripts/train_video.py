r"""Train a video DiT with sequence parallelism (rectified flow on latents).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/train_video.py --sp 2 \
        --model stdit-tiny --steps 300

Checkpoints go to <output-dir>/checkpoints/step_N (written aside, fsynced, swapped in; the
newest --keep-checkpoints are kept), the final model to <output-dir>/final (EMA weights, with
the settings sample_video.py needs), the loss history to <output-dir>/losses.json and .png.
The run is the same at any dp × sp layout with the same --global-batch, and --resume latest
continues it exactly, at any layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

from dspzoo.domains.video.training import VideoTrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`VideoTrainConfig` field, with its description and choices."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(VideoTrainConfig)
    for f in dataclasses.fields(VideoTrainConfig):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        choices = f.metadata.get("choices")
        default = "optional" if f.default is None else f"default: {f.default}"
        if f.name == "output_dir":
            default = "default: outputs/<model>"
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=base,
            default=f.default,
            choices=choices,
            metavar=None if choices else f.name.upper(),
            help=f"{f.metadata.get('help', '')} ({default})",
        )
    return parser


def parse_args(argv: list[str] | None = None) -> VideoTrainConfig:
    """Build a validated :class:`VideoTrainConfig` from ``--field-name value`` flags."""
    parser = build_parser()
    cfg = VideoTrainConfig(**vars(parser.parse_args(argv)))
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
        logging.getLogger("dspzoo.video.train").info(
            "session losses: first %.4f, last %.4f; output in %s",
            result["losses"][0],
            result["losses"][-1],
            result["output_dir"],
        )


if __name__ == "__main__":
    main()

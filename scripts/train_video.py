"""Train a video DiT with sequence parallelism (rectified flow on latents).

    accelerate launch --multi_gpu --num_processes 2 scripts/train_video.py --sp 2 \
        --model stdit-tiny --steps 300 --output-dir outputs/stdit-tiny

Every field of :class:`dspzoo.domains.video.training.VideoTrainConfig` is a flag
(``--batch-size``, ``--lr``, ``--mixed-precision bf16``, ``--data path/to/videos``,
``--resume latest``, ...). Checkpoints go to ``<output-dir>/checkpoints/step_N`` (Accelerate
state, written atomically); the final model to ``<output-dir>/final`` (``save_pretrained``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

from dspzoo.domains.video.training import VideoTrainConfig, train


def parse_args(argv: list[str] | None = None) -> VideoTrainConfig:
    """Build a :class:`VideoTrainConfig` from ``--field-name value`` flags."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(VideoTrainConfig)
    for f in dataclasses.fields(VideoTrainConfig):
        if f.name == "extra":
            continue
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=base,
            default=f.default,
            help=f"default: {f.default}",
        )
    return VideoTrainConfig(**vars(parser.parse_args(argv)))


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    cfg = parse_args()
    result = train(cfg)
    if result["is_main"]:
        logging.getLogger("dspzoo.video.train").info(
            "final loss %.4f (first %.4f); saved to %s/final",
            result["losses"][-1],
            result["losses"][0],
            result["output_dir"],
        )


if __name__ == "__main__":
    main()

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
import logging

from dspzoo.core import configflags
from dspzoo.domains.video.training import VideoTrainConfig, train

SHOWN_DEFAULTS = {"output_dir": "default: outputs/<model>"}


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`VideoTrainConfig` field, with its description and choices."""
    return configflags.build_parser(VideoTrainConfig, __doc__, SHOWN_DEFAULTS)


def parse_args(argv: list[str] | None = None) -> VideoTrainConfig:
    """Build a validated :class:`VideoTrainConfig` from ``--field-name value`` flags."""
    return configflags.parse_config(VideoTrainConfig, argv, __doc__, SHOWN_DEFAULTS)


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

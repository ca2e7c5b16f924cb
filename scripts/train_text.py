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
import logging

from dspzoo.core import configflags
from dspzoo.domains.text.training import TextTrainConfig, train

SHOWN_DEFAULTS = {"output_dir": "default: outputs/<model>"}


def build_parser() -> argparse.ArgumentParser:
    """One flag per :class:`TextTrainConfig` field, with its description and choices."""
    return configflags.build_parser(TextTrainConfig, __doc__, SHOWN_DEFAULTS)


def parse_args(argv: list[str] | None = None) -> TextTrainConfig:
    """Build a validated :class:`TextTrainConfig` from ``--field-name value`` flags."""
    return configflags.parse_config(TextTrainConfig, argv, __doc__, SHOWN_DEFAULTS)


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

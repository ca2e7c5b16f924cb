r"""Ship a trained video or text model inside the package (``zoo/weights/<name>``) with its card.

    python scripts/ship_model.py video outputs/stdit-mini/final --name stdit-mini-shapes \
        --command "python scripts/train_video.py --sp 1 --model stdit-mini --steps 3000 ..."
    python scripts/ship_model.py text outputs/bytelm-tiny/final --name bytelm-tiny-stdlib \
        --command "python scripts/train_text.py ..."

The weights are stored in fp16; the card's figures are measured on exactly those weights (so
``tests/test_shipped_models.py`` can recompute them), with the domain's evaluation function:
``dspzoo.domains.video.evaluation.evaluate`` (``dspzoo.domains.mamba.sampling.evaluate`` for the
video Mamba DiT: its own sampler, the same figures) or
``dspzoo.domains.text.evaluation.heldout_bits_per_byte`` (any byte LM: ``bytelm``, ``mambalm``).
The protein and weather domains ship through their own ``ship_trained`` functions (docs/protein.md, docs/weather.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

import torch

from dspzoo.core.argparser import CommandParser
from dspzoo.zoo import from_pretrained, load_extra, ship_pretrained
from dspzoo.zoo.cli import load_domains
from dspzoo.zoo.pretrained import _read_meta
from dspzoo.zoo.shipped import resolve_pretrained, round_to_shipped_precision

# the function giving a video family's card figures (its own sampler, the same metrics)
VIDEO_EVALUATION = {
    "videomamba": "dspzoo.domains.mamba.sampling.evaluate",
}
DEFAULT_VIDEO_EVALUATION = "dspzoo.domains.video.evaluation.evaluate"


def video_card(model: torch.nn.Module, extra: dict, family: str) -> dict:
    path = VIDEO_EVALUATION.get(family, DEFAULT_VIDEO_EVALUATION)
    module, function = path.rsplit(".", 1)
    evaluate = getattr(importlib.import_module(module), function)
    settings = extra["sampling"]
    return {
        "data": f"built-in moving shapes ({settings['frames']} frames of "
        f"{settings['size']}×{settings['size']} px, 4 classes)",
        "metrics": evaluate(model, settings),
        "eval": f"{path}(model, load_extra(name)['sampling'])",
    }


def text_card(model: torch.nn.Module, extra: dict, family: str) -> dict:
    from dspzoo.domains.text.data import resolve_data
    from dspzoo.domains.text.evaluation import corpus_digest, heldout_bits_per_byte

    training = extra["training"]
    return {
        "data": f"the Python {platform.python_version()} standard library's sources "
        f"(built-in corpus), {training['seq_len']}-byte windows",
        "metrics": {"val_bpb": heldout_bits_per_byte(model, training["seq_len"])},
        "eval": "dspzoo.domains.text.evaluation.heldout_bits_per_byte(model, seq_len)",
        "corpus_digest": corpus_digest(resolve_data(training.get("data", "stdlib"))),
    }


CARDS = {"video": video_card, "text": text_card}


def main() -> None:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("domain", choices=sorted(CARDS))
    parser.add_argument("folder", help="the trained model folder (<output-dir>/final)")
    parser.add_argument("--name", required=True, help="<family>-<config>-<data>")
    parser.add_argument("--command", required=True, help="the exact command that trained it")
    parser.add_argument("--notes", default="", help="anything a user should know")
    args = parser.parse_args()
    load_domains()
    torch.manual_seed(0)
    model = round_to_shipped_precision(from_pretrained(args.folder).eval())
    extra = load_extra(args.folder)
    family = _read_meta(resolve_pretrained(args.folder))["family"]
    card = CARDS[args.domain](model, extra, family) | {
        "command": args.command,
        "notes": args.notes,
    }
    # folders written before training recorded it: the run's train_config.json names the model
    config_name = (
        _read_meta(resolve_pretrained(args.folder)).get("config_name")
        or json.loads((Path(args.folder).parent / "train_config.json").read_text())["model"]
    )
    path = ship_pretrained(model, args.name, config_name=config_name, extra=extra, card=card)
    print(f"shipped {args.name} to {path}: {card['metrics']}")


if __name__ == "__main__":
    sys.exit(main())

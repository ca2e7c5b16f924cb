"""Launched by tests/test_mamba_training.py on 2 processes: 3-step Mamba LM runs at SP 2.

    accelerate launch --multi_gpu --num_processes 2 tests/mamba_training_driver.py \
        <byte file> <output folder> <strategy> <model> [<model> ...]

Rank 0 writes ``<output folder>/losses.json``: ``{model: [loss per step]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dspzoo.domains.mamba.training import MambaTrainConfig, train


def main() -> None:
    data, out, strategy, *models = sys.argv[1:]
    losses = {}
    for model in models:
        cfg = MambaTrainConfig(model=model, sp=2, sp_strategy=strategy, seq_len=19, steps=3,
                               global_batch=2, warmup=1, eval_every=0, log_every=3, save_every=0,
                               data=data, output_dir=str(Path(out) / model))  # fmt: skip
        losses[model] = train(cfg)["losses"]
    if dist.get_rank() == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()

"""Launched by tests/test_text.py on 2 processes: the 5-step text run under every strategy.

    python -m torch.distributed.run --nproc_per_node 2 tests/text_strategies_driver.py \
        <byte file> <output folder> <strategy> [<strategy> ...]

Rank 0 writes ``<output folder>/losses.json``: ``{strategy: [loss per step]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dspzoo.domains.text.training import TextTrainConfig, train


def main() -> None:
    data, out, *strategies = sys.argv[1:]
    losses = {}
    for strategy in strategies:
        cfg = TextTrainConfig(
            model="bytelm-tiny",
            sp=2,
            sp_strategy=strategy,
            seq_len=32,
            steps=5,
            global_batch=2,
            warmup=2,
            eval_every=0,
            log_every=5,
            save_every=0,
            data=data,
            output_dir=str(Path(out) / strategy),
        )
        losses[strategy] = train(cfg)["losses"]
    if dist.get_rank() == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()

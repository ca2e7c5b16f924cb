"""Launched by tests/test_mamba_training.py on 2 processes: 3-step runs of Mamba models at SP 2.

    accelerate launch --multi_gpu --num_processes 2 tests/mamba_training_driver.py \
        <byte file> <output folder> <strategy> <model> [<model> ...]

Mamba LMs (``mambalm``, ``mamba2lm``, ``hybridlm``) train on the byte file with the Mamba Task,
video Mamba DiTs (``videomamba``) on moving shapes with the video Task, weather Mambas
(``weathermamba``) on the built-in A1B data with the weather Task. Rank 0 writes
``<output folder>/losses.json``: ``{model: [loss per step]}``. :func:`train_model` is also the
test's one-process reference (``sp=1``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

#: ``<model>@fsdp-ac``: the Mamba LM ``<model>`` under ``--fsdp --activation-checkpointing``
FSDP_AC = "@fsdp-ac"


def train_model(model: str, sp: int, strategy: str, data: str, out: Path) -> list[float]:
    """Three steps of ``model`` at SP ``sp``: the loss per step (``<LM>@fsdp-ac``: sharded
    weights and FSDP's checkpointing of the blocks, which recomputes them in the region they
    ran in; the LM's own checkpointing would recompute its mixers on sharded weights)."""
    sharded = model.endswith(FSDP_AC) and sp > 1
    model = model.removesuffix(FSDP_AC)
    if model.startswith("videomamba"):
        from dspzoo.domains.video.training import VideoTrainConfig
        from dspzoo.domains.video.training import train as train_video

        video = VideoTrainConfig(model=model, sp=sp, sp_strategy=strategy, steps=3,
                                 global_batch=2, frames=3, size=8, num_samples=4, warmup=1,
                                 log_every=3, save_every=0, output_dir=str(out))  # fmt: skip
        return train_video(video)["losses"]
    if model.startswith("weathermamba"):
        from dspzoo.domains.weather.training import WeatherTrainConfig
        from dspzoo.domains.weather.training import train as train_weather

        weather = WeatherTrainConfig(model=model, sp=sp, sp_strategy=strategy, data="a1b",
                                     history=2, leads="1", holdout_from=2090, steps=3,
                                     global_batch=2, warmup=1, eval_every=0, log_every=3,
                                     save_every=0, output_dir=str(out))  # fmt: skip
        return train_weather(weather)["losses"]
    from dspzoo.domains.mamba.training import MambaTrainConfig, train

    cfg = MambaTrainConfig(model=model, sp=sp, sp_strategy=strategy, seq_len=19, steps=3,
                           global_batch=2, warmup=1, eval_every=0, log_every=3, save_every=0,
                           data=data, output_dir=str(out), fsdp=sharded,
                           activation_checkpointing=sharded)  # fmt: skip
    return train(cfg)["losses"]


def main() -> None:
    data, out, strategy, *models = sys.argv[1:]
    losses = {m: train_model(m, 2, strategy, data, Path(out) / m) for m in models}
    if dist.get_rank() == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()

"""Training a Mamba LM on bytes: the text domain's Task with a Mamba model.

``dspzoo train mamba --model mambalm-small`` (or ``mamba2lm-…``, or the hybrid ``hybridlm-…``)
trains on the built-in stdlib corpus (or any raw byte file, ``--data``) exactly as ``dspzoo
train text`` trains a ByteLM: the same data, loss (bits per byte), held-out evaluation, checkpoints and resume. Only the model
differs, and the default strategy: ``dsp``. The video Mamba DiT trains with the video Task:
``dspzoo train video --model videomamba-tiny``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.core.train import flag, load_initial_weights, train_task
from dspzoo.domains.text.training import TextTask, TextTrainConfig

from ...core.errors import UsageError

LM_FAMILIES = ("mambalm", "mamba2lm", "hybridlm")


@dataclass
class MambaTrainConfig(TextTrainConfig):
    """Everything a Mamba LM training run needs; every field is a command-line flag."""

    model: str = flag(
        "mambalm-small", "zoo Mamba LM (mambalm-…, mamba2lm-… or hybridlm-…; `dspzoo list`)"
    )

    def model_checkpointing(self) -> bool:
        # under --fsdp the LM's own checkpoint of its mixers would recompute them outside
        # FSDP's unshard (their weights still sharded DTensors): FSDP checkpoints the blocks
        return super().model_checkpointing() and not self.fsdp

    sp_strategy: str = flag(
        "dsp",
        "sequence-parallel strategy; every strategy runs the scans over the sharded sequence "
        "with a scan method (dsp: the planner's choice, state passing)",
        tuple(STRATEGIES),
    )


def build_model(cfg: MambaTrainConfig) -> torch.nn.Module:
    """The zoo model, seeded from ``cfg.seed`` alone (global RNG untouched); byte vocabulary."""
    from dspzoo.zoo import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = create_model(cfg.model, checkpoint=cfg.model_checkpointing())
    if model.config.vocab_size < 256:
        raise UsageError(
            f"{cfg.model} has vocab_size {model.config.vocab_size}; byte data needs at least 256"
        )
    return load_initial_weights(model, cfg)


class MambaTask(TextTask):
    """Byte-level language modelling with a Mamba LM."""

    config_type = MambaTrainConfig
    name = "mamba"
    families = LM_FAMILIES  # the video and weather Mambas train with their domains' Tasks
    cfg: MambaTrainConfig

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg)


def train(cfg: MambaTrainConfig) -> dict:
    """Run (or resume) training; returns what :func:`dspzoo.domains.text.training.train` does."""
    return train_task(MambaTask(cfg))

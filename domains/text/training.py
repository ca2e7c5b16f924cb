"""Byte-level language-model training under sequence parallelism, for ``accelerate launch``.

Each SP group holds one share of the global batch of ``seq_len``-byte windows. ``sp.enter``
splits every window's bytes over the group; the strategy (``--sp-strategy``: ``lss``,
``ring``, ``ulysses``, ...) decides what causal attention over the sharded sequence
communicates; each rank takes the cross-entropy of its own bytes (:func:`lm_loss`, the
gradient contract), and DDP averages gradients over dp × sp (under ``megatron_sp``, which
shards the weights: :class:`~dspzoo.core.train.tensor_parallel.TensorParallelTraining`).

The only randomness of a run is the data order, a function of ``(seed, epoch)``
(:class:`dspzoo.core.data.SPBatchSampler`), and the initial weights, a function of ``seed``:
so the loss sequence is the same at every dp × sp layout with the same ``--global-batch``, and
a run resumed from a checkpoint (at any layout) continues exactly. Losses are reported in bits
per byte (cross-entropy / ln 2); ``--eval-every`` measures bits per byte on held-out windows
(the last 5 % of the data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.core.train import (
    RunConfig,
    Task,
    check_values,
    flag,
    load_initial_weights,
    train_task,
)

from ...core.errors import UsageError
from .data import ByteWindows, resolve_data
from .model import lm_loss

LN2 = math.log(2.0)


@dataclass
class TextTrainConfig(RunConfig):
    """Everything a training run needs; every field is a command-line flag."""

    MODEL_CHECKPOINTING = True  # ByteLM recomputes its blocks (create_model(checkpoint=...))

    model: str = flag("bytelm-small", "zoo model name (see `dspzoo list`)")
    sp_strategy: str = flag(
        "lss_zigzag",
        "sequence-parallel strategy, i.e. how causal attention over the sharded sequence "
        "communicates (dsp plans a hybrid with an embedded method for this 1-D model; "
        "lss_zigzag: LSS with balanced causal work, lss: the paper's contiguous layout, "
        "lss_balanced: contiguous with balanced causal work)",
        tuple(STRATEGIES),
    )
    seq_len: int = flag(512, "bytes per training window (the model's sequence length)")
    steps: int = flag(
        1000,
        "total optimisation steps, counted from the start of training (a resumed run goes on to it)",
    )
    global_batch: int = flag(
        8,
        "windows per step over all data-parallel groups; each DP group takes global_batch / dp. "
        "Keep it fixed to get the same run at any dp × sp layout",
    )
    lr: float = flag(1e-3, "peak AdamW learning rate")
    weight_decay: float = flag(0.1, "AdamW weight decay (matrices only, not norms or biases)")
    warmup: int = flag(50, "linear warm-up steps, then cosine decay to 10%% of the peak")
    activation_checkpointing: bool = flag(
        False, "recompute every block in the backward pass instead of keeping its activations"
    )
    seed: int = flag(0, "seed of the initial weights and the data order")
    data: str = flag(
        "stdlib",
        "'stdlib' (the Python standard library's sources, built and cached at first use) or "
        "the path of a raw byte file such as enwik8",
    )
    val_fraction: float = flag(
        0.05,
        "share of the data, at its end, held out for validation (0: none, with --eval-every 0)",
    )
    eval_every: int = flag(100, "measure validation bits per byte every n steps (0: off)")
    eval_windows: int = flag(32, "held-out windows per validation (the first ones)")
    save_every: int = flag(
        200, "save a checkpoint every n steps (0: only at --stop-after and the last step)"
    )

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        super().validate()
        check_values(self, positive=("seq_len", "eval_windows"), non_negative=("eval_every",))

        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_fraction == 0.0 and self.eval_every:
            raise UsageError(
                "--val-fraction 0 holds no bytes out to evaluate on: pass --eval-every 0 too "
                "(no validation), or keep a validation share"
            )


def build_model(cfg: TextTrainConfig) -> torch.nn.Module:
    """The zoo model; its initial weights depend on ``cfg.seed`` only (global RNG untouched)."""
    from dspzoo.zoo import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = create_model(cfg.model, checkpoint=cfg.model_checkpointing())
    mc = model.config
    if mc.position == "learned" and cfg.seq_len > mc.max_len:
        raise UsageError(
            f"--seq-len {cfg.seq_len} exceeds {cfg.model}'s learned position table "
            f"(max_len={mc.max_len}); pick a rotary model or a shorter --seq-len"
        )
    return load_initial_weights(model, cfg)


def build_optimizer(model: torch.nn.Module, cfg: TextTrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (linear and embedding weights) only."""
    params = {id(p): p for p in model.parameters()}.values()  # a tied weight counts once
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other}]
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))


class TextTask(Task):
    """Byte-level language modelling: the text domain's part of a training run."""

    config_type = TextTrainConfig
    name = "text"
    loss_name = "bits/byte"
    families = ("bytelm",)
    run_settings = ("global_batch", "seq_len", "seed")
    cfg: TextTrainConfig

    def build_data(self) -> ByteWindows:
        path = resolve_data(self.cfg.data)
        if self.cfg.eval_every:  # without evaluation the held-out split is not read
            self.val_data = ByteWindows(path, self.cfg.seq_len, "val", self.cfg.val_fraction)
        return ByteWindows(path, self.cfg.seq_len, "train", self.cfg.val_fraction)

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model, self.cfg)

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        return self.cfg.seq_len

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int, sp: Any
    ) -> torch.Tensor:
        """Cross-entropy of this rank's bytes of each window (:func:`lm_loss`)."""
        logits = model(batch["tokens"], sp=sp, gather_output=False)
        return lm_loss(logits, batch["targets"], sp)

    def report(self, loss: float) -> float:
        return loss / LN2

    def evaluates_at(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, sp: Any, step: int) -> float:
        """Bits per byte on the first ``--eval-windows`` held-out windows.

        DP group ``d`` scores windows ``d, d + dp, …``; inside an SP group every rank scores
        its own bytes of each window, and one all-reduce over the world adds up the nats and
        bytes.
        """
        cfg, mesh, device = self.cfg, self.mesh, self.device
        windows = list(range(min(cfg.eval_windows, len(self.val_data))))
        windows = windows[mesh.dp_rank :: mesh.dp_size]
        totals = torch.zeros(2, dtype=torch.float64)
        model.eval()
        for first in range(0, len(windows), self.batch_per_dp):
            items = [self.val_data[i] for i in windows[first : first + self.batch_per_dp]]
            tokens = torch.stack([it["tokens"] for it in items]).to(device)
            targets = torch.stack([it["targets"] for it in items]).to(device)
            with self.accelerator.autocast():
                logits = model(tokens, sp=sp, gather_output=False)
            mine = sp.shard_like(targets, logits)
            nats = F.cross_entropy(
                logits.tensor.flatten(0, -2).float(), mine.flatten(), reduction="sum"
            )
            totals += torch.stack([nats.double().cpu(), torch.tensor(float(mine.numel()))])
        model.train()
        if dist.is_available() and dist.is_initialized():
            totals = totals.to(device)
            dist.all_reduce(totals)
            totals = totals.cpu()
        return float(totals[0] / totals[1]) / LN2

    def log_evaluation(self, step: int, figures: float) -> None:
        self.logger.info("step %d validation %.4f bits/byte", step, figures)

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        training = {
            "seq_len": self.cfg.seq_len,
            "data": self.cfg.data,
            "steps": self.cfg.steps,
            "train_bpb": history[-1] if history else None,
            "val_bpb": evals[-1][1] if evals else None,
        }
        return {"training": training}

    def history_record(self, history: list[float], evals: list) -> dict[str, Any]:
        return {"train_bpb": history, "val_bpb": evals}


def train(cfg: TextTrainConfig) -> dict:
    """Run (or resume) training (:class:`~dspzoo.core.train.Trainer`). Returns on every rank::

    {"losses": this session's bits per byte, "loss_history": all of them from step 1,
     "evals": [[step, validation bits per byte], ...], "tokens_per_s": ...,
     "activation_bytes": ..., "output_dir": ..., "is_main": ...}
    """
    return train_task(TextTask(cfg))

"""The flags every training script shares: layout, strategy, optimisation, saving, resuming.

Domain configs subclass :class:`RunConfig`, add their own fields and redeclare a shared one to
change its default (a redeclared field keeps its place). Every field is a command-line flag
(:mod:`dspzoo.core.train.flags`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..durable import write_json_durably
from ..errors import UsageError
from ..parallel.strategies import STRATEGIES
from .flags import check_values, flag

# strategies the training scripts cannot drive yet (every one can: megatron_sp, which shards
# the weights, runs through core/train/tensor_parallel.py)
NOT_WIRED: tuple[str, ...] = ()


@dataclass
class RunConfig:
    """Shared training flags; see the module docstring."""

    #: the domain's model recomputes its blocks itself (``create_model(..., checkpoint=True)``):
    #: ``--activation-checkpointing`` then works without ``--fsdp``, and FSDP does not wrap again
    MODEL_CHECKPOINTING: ClassVar[bool] = False

    model: str = flag("", "zoo model name (see `dspzoo list`)")
    sp: int = flag(2, "ranks per sequence-parallel group; must divide the number of processes")
    sp_strategy: str = flag(
        "dsp",
        "how the SP group runs the model: dsp switches the sharded dim between stages; the "
        "embedded methods shard one dim and communicate inside attention",
        tuple(STRATEGIES),
    )
    steps: int = flag(
        300,
        "total optimisation steps, counted from the start of training (a resumed run goes on to it)",
    )
    global_batch: int = flag(
        4,
        "samples per step over all data-parallel groups; each DP group takes global_batch / dp. "
        "Keep it fixed to get the same run at any dp × sp layout",
    )
    lr: float = flag(3e-4, "peak AdamW learning rate")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    warmup: int = flag(20, "linear warm-up steps, then cosine decay to 10%% of the peak")
    grad_clip: float = flag(1.0, "clip the global gradient norm to this value (0: off)")
    mixed_precision: str = flag(
        "no", "autocast precision (under --fsdp: the sharding's compute precision)",
        ("no", "fp16", "bf16"),
    )  # fmt: skip
    fsdp: bool = flag(
        False,
        "shard weights, gradients and optimizer state over the dp × sp world (FSDP2 "
        "fully_shard, one unit per block); checkpoints hold full tensors and resume at any "
        "layout, with or without it",
    )
    activation_checkpointing: bool = flag(
        False, "with --fsdp: recompute each block's forward in backward instead of keeping it"
    )
    seed: int = flag(0, "seed of the weights, the data order and every random draw")
    num_workers: int = flag(0, "dataloader worker processes per rank")
    output_dir: str | None = flag(None, "where checkpoints, logs and the final model go")
    save_every: int = flag(
        100,
        "save a checkpoint every n steps; the last step and --stop-after are always saved, so "
        "a finished run continues with a larger --steps and --resume latest",
    )
    keep_checkpoints: int = flag(3, "keep the newest n checkpoints (0: keep all)")
    log_every: int = flag(10, "log (and average the reported loss over) every n steps")
    resume: str | None = flag(None, "a checkpoint folder, or 'latest' in <output-dir>/checkpoints")
    stop_after: int | None = flag(
        None, "end this session after n steps with a checkpoint (for time-limited jobs)"
    )
    init_from: str | None = flag(
        None,
        "fine-tune: start from these weights (a shipped model's name, see `dspzoo list "
        "--pretrained`, or a save_pretrained folder) instead of a random init; the model "
        "config comes from them",
    )

    def __post_init__(self) -> None:
        if self.init_from:
            self.model = model_of_weights(self.init_from, self.model, _default_model(self))
        if self.output_dir is None:
            self.output_dir = f"outputs/{self.model}"

    def model_checkpointing(self) -> bool:
        """Whether the model recomputes its own blocks (``create_model(..., checkpoint=...)``)
        rather than FSDP's unit checkpointing (:class:`~.fsdp.ShardingSettings`)."""
        return self.activation_checkpointing and self.MODEL_CHECKPOINTING

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for shared values no run can use."""
        check_values(
            self,
            positive=("sp", "steps", "global_batch", "log_every"),
            non_negative=("save_every", "keep_checkpoints", "num_workers", "warmup"),
        )
        if self.stop_after is not None and self.stop_after < 1:
            raise UsageError(f"--stop-after must be >= 1, got {self.stop_after}")
        if self.activation_checkpointing and not (self.fsdp or self.MODEL_CHECKPOINTING):
            raise UsageError("--activation-checkpointing applies to --fsdp runs; add --fsdp")
        if self.fsdp and self.sp_strategy == "megatron_sp":
            raise UsageError(
                "--fsdp shards the weights over dp × sp, and --sp-strategy megatron_sp shards "
                "them over the SP group already: drop --fsdp or pick another strategy"
            )
        if self.sp_strategy in NOT_WIRED:
            raise UsageError(
                f"--sp-strategy {self.sp_strategy}: the training scripts do not drive it yet; "
                f"choose one of {[s for s in STRATEGIES if s not in NOT_WIRED]}"
            )


def _default_model(cfg: RunConfig) -> str:
    return type(cfg).__dataclass_fields__["model"].default


def model_of_weights(init_from: str, model: str, default: str = "") -> str:
    """The zoo config ``--init-from``'s weights were saved as; ``--model`` may only agree
    (``model == default``: taken for no ``--model`` at all, and not compared)."""
    from dspzoo.zoo.pretrained import _read_meta
    from dspzoo.zoo.registry import resolve_name
    from dspzoo.zoo.shipped import resolve_pretrained

    saved = _read_meta(resolve_pretrained(init_from)).get("config_name")
    if not saved:
        raise UsageError(
            f"--init-from {init_from}: the folder does not record its zoo config name; pass "
            f"--model as well"
        )
    if model and model != default and resolve_name(model) != resolve_name(saved):
        raise UsageError(
            f"--init-from {init_from} holds a {saved} model but --model is {model}; drop "
            f"--model (it comes from the weights) or pick weights of {model}"
        )
    return saved


def load_initial_weights(model: Any, cfg: RunConfig) -> Any:
    """Copy ``--init-from``'s weights into ``model`` (a fine-tune; no-op without the flag).

    Called right after a domain builds its model, before the optimizer and EMA see it, so the
    run starts from those weights at any layout. A model built for other data (other channels,
    classes or sizes) is refused with the mismatching keys.
    """
    if cfg.init_from:
        from dspzoo.zoo.pretrained import load_weights
        from dspzoo.zoo.shipped import resolve_pretrained

        load_weights(model, resolve_pretrained(cfg.init_from))
    return model


def warmup_cosine(cfg: RunConfig) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``cfg.warmup`` steps, then cosine decay to 10 %."""

    def fn(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def train_loader(cfg: RunConfig, dataset: Any, mesh: Any, **options: Any) -> Any:
    """This DP group's share of every global batch of ``dataset``, in the run's sample order.

    ``sp_dataloader`` with ``--global-batch / dp`` samples per step, ``--seed`` and
    ``--num-workers``; ``options`` (``device``, ``collate_fn``) go to it unchanged.
    """
    from ..data import sp_dataloader

    return sp_dataloader(
        dataset,
        mesh,
        cfg.global_batch // mesh.dp_size,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        **options,
    )


def start_run(cfg: RunConfig) -> tuple[Any, Any, Any, Path]:
    """Validate ``cfg``, build ``(accelerator, mesh, sp)`` and the output folder.

    The global batch must split evenly over the data-parallel groups. Nothing is written yet:
    the trainer records ``train_config.json`` (:func:`record_run_config`, call it yourself
    when you drive a run without the Trainer) once the run is known to start (an earlier
    run's folder is never overwritten by a refused one). Returns ``(accelerator, mesh, sp,
    output_dir)``.
    """
    from ..accelerate import setup_accelerate

    cfg.validate()
    accelerator, mesh, sp = setup_accelerate(
        cfg.sp, seed=cfg.seed, strategy=cfg.sp_strategy, mixed_precision=cfg.mixed_precision
    )
    if cfg.global_batch % mesh.dp_size:
        raise UsageError(
            f"--global-batch {cfg.global_batch} is not divisible by the {mesh.dp_size} "
            f"data-parallel groups ({mesh.world_size} processes / SP {cfg.sp}); choose a "
            f"multiple of {mesh.dp_size}"
        )
    return accelerator, mesh, sp, Path(cfg.output_dir)


def record_run_config(cfg: RunConfig, mesh: Any, device: Any = "cpu") -> None:
    """The main process writes ``<cfg.output_dir>/train_config.json`` (durably: written aside,
    fsynced, swapped in): the settings of the session that is starting. Collective: a folder
    it cannot write raises the same error on every rank (``device``: where the flag is
    all-reduced, the run's device)."""
    from ..parallel.validate import validate_collectively

    output_dir = Path(cfg.output_dir)

    def write() -> None:
        if not mesh.is_main:
            return
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            write_json_durably(output_dir / "train_config.json", asdict(cfg))
        except OSError as exc:
            raise UsageError(f"--output-dir {output_dir} cannot be written: {exc}") from exc

    group = mesh.grad_group if mesh.world_size > 1 else None
    validate_collectively(write, group, "the run's output folder", device)

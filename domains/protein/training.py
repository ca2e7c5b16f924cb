"""Distogram training of the Evoformer under sequence parallelism, for ``accelerate launch``.

Every rank of an SP group loads the same samples (:func:`dspzoo.core.sp_dataloader`); each
training step crops them to ``--crop-size`` contiguous residues and subsamples their MSA rows
with draws keyed by ``(seed, step, global sample index)``
(:func:`~dspzoo.domains.protein.dataset.training_batch`), so the batch is identical inside an
SP group, independent of the dp × sp layout, and exact after a resume at any layout. The model
enters the sharded region itself and returns the gathered distogram; every rank takes the same
distogram cross-entropy (a loss on replicated outputs, the gradient contract of
:mod:`dspzoo.core.loss`), and DDP averages gradients over dp × sp (the Trainer's one policy,
:mod:`dspzoo.core.train.sync`).

Evaluation (``--eval-every`` and at the end) runs the held-out chains whole (up to
``--eval-max-length`` residues) and reports their mean top-L/5 long-range contact precision
beside two baselines (a sequence-separation-only predictor, and the share of contacts among
long-range pairs, i.e. a random ranking), and writes predicted-vs-true contact-map PNGs.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dspzoo.core.parallel.rng import mix_key
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
from .dataset import (
    BUILTIN_DATA,
    ProteinDataset,
    Sample,
    collate,
    crop_and_sample,
    keep_as_list,
    training_batch,
)
from .metrics import (
    contact_precision,
    contact_precision_from_probs,
    contact_probabilities,
    distogram_loss,
    pairwise_distances,
    separation_baseline,
    write_contact_png,
)


@dataclass
class ProteinTrainConfig(RunConfig):
    """Everything a training run needs; every field is a command-line flag."""

    model: str = flag("evoformer-small", "zoo model name (see `dspzoo list`)")
    sp_strategy: str = flag(
        "dsp",
        "sequence-parallel strategy; the Evoformer runs under dsp only (the MSA and pair "
        "activations switch their sharded residue/MSA dims between stages)",
        tuple(STRATEGIES),
    )
    data: str = flag(
        "builtin",
        "'builtin' (the real chains shipped in domains/protein/data_files/pdb_chains) or a "
        "folder of .cif/.pdb files with optional alignments/<entry>_<chain>/*.a3m|*.sto",
    )
    crop_size: int = flag(64, "contiguous residues per training crop")
    max_msa_rows: int = flag(16, "MSA rows per training sample (the query and a random subset)")
    num_recycles: int | None = flag(
        None, "recycling iterations in training and evaluation (default: the model config's)"
    )
    held_out_fraction: float = flag(0.1, "share of entries held out for evaluation")
    split_seed: int = flag(0, "seed of the entry split (independent of --seed)")
    held_out_entries: str = flag(
        "", "comma-separated entries to hold out (replaces the hashed split when given)"
    )
    min_observed: int = flag(16, "skip chains with fewer observed residues")
    lr: float = flag(1e-3, "peak AdamW learning rate")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    eval_every: int = flag(
        100, "evaluate on the held-out chains every n steps (0: only at the end)"
    )
    eval_max_length: int = flag(256, "held-out chains are cropped to their first n residues")
    save_every: int = flag(
        100, "save a checkpoint every n steps (0: only at --stop-after and the last step)"
    )

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        super().validate()
        check_values(
            self,
            positive=("crop_size", "max_msa_rows", "eval_max_length"),
            non_negative=("eval_every", "min_observed"),
        )
        if self.sp_strategy != "dsp":
            raise UsageError(
                f"--sp-strategy {self.sp_strategy}: the Evoformer runs under 'dsp' only (its MSA "
                f"and pair activations are planned together, core/parallel/multiplan.py)"
            )
        if not 0.0 < self.held_out_fraction < 1.0:
            raise UsageError(f"--held-out-fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.num_recycles is not None and self.num_recycles < 0:
            raise UsageError(f"--num-recycles must be >= 0, got {self.num_recycles}")


def data_folder(data: str) -> Path:
    """``--data`` as a folder (``builtin``: the shipped chains)."""
    return BUILTIN_DATA if data == "builtin" else Path(data)


def build_datasets(cfg: ProteinTrainConfig) -> tuple[ProteinDataset, ProteinDataset]:
    """``(train, held_out)`` chains of ``--data`` split by entry."""
    kwargs = {
        "held_out_fraction": cfg.held_out_fraction,
        "split_seed": cfg.split_seed,
        "min_observed": cfg.min_observed,
        "held_out_entries": [e.strip() for e in cfg.held_out_entries.split(",") if e.strip()],
    }
    folder = data_folder(cfg.data)
    return (
        ProteinDataset(folder, "train", **kwargs),
        ProteinDataset(folder, "held_out", **kwargs),
    )


def build_model(cfg: ProteinTrainConfig) -> torch.nn.Module:
    """The zoo model; its initial weights depend on ``cfg.seed`` only (global RNG untouched)."""
    import dspzoo.domains.protein  # noqa: F401  (registers the evoformer family)
    from dspzoo.zoo import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = create_model(cfg.model)
    return load_initial_weights(model, cfg)  # --init-from: a fine-tune


def prediction_settings(cfg: ProteinTrainConfig, held_out: list[str]) -> dict[str, Any]:
    """What prediction and evaluation need besides the weights; saved in the final folder."""
    return {
        "num_recycles": cfg.num_recycles,
        "max_msa_rows": cfg.max_msa_rows,
        "crop_size": cfg.crop_size,
        "data": cfg.data,
        "held_out_fraction": cfg.held_out_fraction,
        "split_seed": cfg.split_seed,
        "min_observed": cfg.min_observed,
        "held_out_entries": cfg.held_out_entries,
        "eval_max_length": cfg.eval_max_length,
        "held_out": held_out,
    }


@torch.no_grad()
def evaluate_samples(
    model: torch.nn.Module,
    samples: list[Sample],
    sp: Any = None,
    num_recycles: int | None = None,
    max_length: int | None = 256,
    png_dir: Path | None = None,
    autocast: Any = None,
) -> list[dict[str, Any]]:
    """Score each chain whole (its first ``max_length`` residues, the first MSA rows up to the
    model's usual depth): distogram loss, top-L/5 long-range contact precision, and the two
    baselines. Writes ``<png_dir>/<chain>.png`` when given. Returns one record per chain.

    With ``sp``, every rank of the SP group must pass the same samples.
    """
    was_training = model.training
    model.eval()
    records = []
    device = next(model.parameters()).device
    for sample in samples:
        cropped = crop_and_sample(sample, max_length, 10**9, key=None)
        batch = {k: v.to(device) for k, v in collate([cropped]).items()}
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = model(batch, sp=sp, num_recycles=num_recycles, outputs=("distogram_logits",))
        logits = out["distogram_logits"].float().cpu()
        pb, pbm = batch["pseudo_beta"].cpu(), batch["pseudo_beta_mask"].cpu()
        ri, sm = batch["residue_index"].cpu(), batch["seq_mask"].cpu()
        precision = contact_precision(logits, pb, pbm, ri, sm, model.config)
        baseline = contact_precision_from_probs(separation_baseline(ri), pb, pbm, ri, sm)
        records.append(
            {
                "name": str(sample["name"]),
                "length": int(sm.sum()),
                "distogram_loss": float(distogram_loss(logits, pb, pbm, model.config)),
                "precision": float(precision[0]),
                "baseline_separation": float(baseline[0]),
                "contact_density": _contact_density(pb[0], pbm[0], ri[0]),
            }
        )
        if png_dir is not None:
            probs = contact_probabilities(logits, model.config)[0]
            write_contact_png(
                png_dir / f"{sample['name']}.png",
                probs,
                pb[0],
                pbm[0],
                f"{sample['name']}: top-L/5 long-range precision {float(precision[0]):.2f}",
            )
    model.train(was_training)
    return records


def _contact_density(pseudo_beta: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> float:
    """Share of contacts among known ``|i−j| ≥ 24`` pairs: a random ranking's expected precision."""
    true = pairwise_distances(pseudo_beta[None])[0] < 8.0
    sep = (index[:, None] - index[None, :]).abs() >= 24
    known = (mask[:, None] * mask[None, :]) > 0
    pairs = sep & known & torch.ones_like(sep).triu(1)
    return float(true[pairs].float().mean()) if pairs.any() else float("nan")


def summarise(records: list[dict[str, Any]]) -> dict[str, float]:
    """Means over chains of every figure (NaN-free chains only for the precisions)."""
    out: dict[str, float] = {"chains": float(len(records))}
    for key in ("precision", "baseline_separation", "contact_density", "distogram_loss"):
        values = [r[key] for r in records if not math.isnan(r[key])]
        out[key] = sum(values) / len(values) if values else float("nan")
    return out


class ProteinTask(Task):
    """Distogram training of the Evoformer: the protein domain's part of a training run."""

    config_type = ProteinTrainConfig
    name = "protein"
    loss_name = "distogram loss"
    families = ("evoformer",)
    run_settings = ("global_batch", "seed", "crop_size", "max_msa_rows")
    cfg: ProteinTrainConfig

    def build_data(self) -> ProteinDataset:
        train_data, self.held_out = build_datasets(self.cfg)
        if self.mesh.is_main:
            self.logger.info(
                "data %s: %d training chains, %d held-out chains (%s)",
                data_folder(self.cfg.data),
                len(train_data),
                len(self.held_out),
                ", ".join(self.held_out.names),
            )
        return train_data

    def loader_options(self) -> dict[str, Any]:
        return {"collate_fn": keep_as_list}  # cropped per step in loss()

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg)

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        return self.cfg.crop_size

    def fsdp_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The sublayers of every Evoformer block: a block begins on ``m`` and ``z`` whose
        switch the plan may have overlapped with the previous block (see ``sublayer_units``)."""
        from dspzoo.core.train.fsdp import sublayer_units

        return sublayer_units(model)

    def step_batch(self, samples: list[Sample], step: int) -> dict[str, torch.Tensor]:
        """This DP group's batch of ``step``: keyed crops and MSA rows of its samples."""
        first = self.first_sample(step)
        batch = training_batch(
            samples,
            self.cfg.seed,
            step,
            range(first, first + len(samples)),
            self.cfg.crop_size,
            self.cfg.max_msa_rows,
        )
        return {k: v.to(self.device) for k, v in batch.items()}

    def loss(
        self, model: torch.nn.Module, samples: list[Sample], step: int, sp: Any
    ) -> torch.Tensor:
        """The distogram cross-entropy of the (replicated) output; crops, MSA rows and dropout
        keyed by ``(seed, step, global sample index)``."""
        batch = self.step_batch(samples, step)
        out = model(
            batch,
            sp=sp,
            num_recycles=self.cfg.num_recycles,
            rng_key=mix_key(self.cfg.seed, step, "evoformer-dropout"),
            batch_offset=self.first_sample(step),
        )
        config = self.accelerator.unwrap_model(model).config
        return distogram_loss(
            out["distogram_logits"], batch["pseudo_beta"], batch["pseudo_beta_mask"], config
        )

    def evaluate(self, model: torch.nn.Module, sp: Any, step: int) -> dict[str, float]:
        """Held-out figures: DP group ``d`` scores chains ``d, d + dp, …``; the records are
        gathered on every rank. The first rank of each DP group writes its chains' PNGs under
        ``<output-dir>/contact_maps/step_<step>/``."""
        mesh = self.mesh
        mine = self.held_out.samples[mesh.dp_rank :: mesh.dp_size]
        png_dir = self.output_dir / "contact_maps" / f"step_{step}"
        writes = mesh.sp_rank == 0
        records = evaluate_samples(
            model,
            mine,
            sp,
            self.cfg.num_recycles,
            self.cfg.eval_max_length,
            png_dir if writes else None,
            self.accelerator.autocast,
        )
        if dist.is_available() and dist.is_initialized() and mesh.dp_size > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records if writes else [])
            records = [r for part in gathered for r in part]
        return summarise(records)

    def log_evaluation(self, step: int, figures: dict[str, float]) -> None:
        self.logger.info(
            "step %d held-out (%d chains): top-L/5 long-range contact precision %.3f "
            "(separation-only baseline %.3f, contact density %.3f), distogram loss %.3f",
            step,
            int(figures["chains"]),
            figures["precision"],
            figures["baseline_separation"],
            figures["contact_density"],
            figures["distogram_loss"],
        )

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        return {
            "protein": prediction_settings(self.cfg, self.held_out.names),
            "training": {"steps": self.cfg.steps, "train_loss": history[-1] if history else None},
            "evaluation": evals[-1][1] if evals else None,
        }

    def history_record(self, history: list[float], evals: list) -> dict[str, Any]:
        return {"train_loss": history, "evals": evals}


def train(cfg: ProteinTrainConfig) -> dict:
    """Run (or resume) training (:class:`~dspzoo.core.train.Trainer`). Returns on every rank::

    {"losses": this session's losses, "loss_history": all from step 1,
     "evals": [[step, {figures}], ...], "activation_bytes": ..., "output_dir": ..., "is_main": ...}
    """
    return train_task(ProteinTask(cfg))


def held_out_of(settings: dict[str, Any]) -> ProteinDataset:
    """The held-out chains a model was evaluated on, from its saved ``protein`` settings."""
    entries = [e.strip() for e in str(settings.get("held_out_entries", "")).split(",")]
    return ProteinDataset(
        data_folder(settings.get("data", "builtin")),
        "held_out",
        held_out_fraction=settings.get("held_out_fraction", 0.1),
        split_seed=settings.get("split_seed", 0),
        min_observed=settings.get("min_observed", 16),
        held_out_entries=[e for e in entries if e] or None,
    )


def evaluate_pretrained(
    model_dir: str, png_dir: str | Path | None = None
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Recompute a trained model's held-out figures on one process: load ``model_dir`` (a
    ``save_pretrained`` folder or a shipped name), rebuild its held-out chains from the saved
    settings, and score them whole (:func:`evaluate_samples`). Returns ``(summary, records)``."""
    import dspzoo.domains.protein  # noqa: F401  (registers the evoformer family)
    from dspzoo.zoo import from_pretrained, load_extra
    from dspzoo.zoo.shipped import resolve_pretrained

    folder = resolve_pretrained(model_dir)
    settings = load_extra(folder)["protein"]
    model = from_pretrained(folder, expected_family="evoformer")
    held_out = held_out_of(settings)
    if held_out.names != settings["held_out"]:
        raise UsageError(
            f"{model_dir}: the held-out chains rebuilt from the saved settings "
            f"({held_out.names}) differ from those recorded ({settings['held_out']})"
        )
    records = evaluate_samples(
        model,
        held_out.samples,
        num_recycles=settings.get("num_recycles"),
        max_length=settings.get("eval_max_length", 256),
        png_dir=Path(png_dir) if png_dir else None,
    )
    return summarise(records), records


def ship_trained(
    final_dir: str, command: str, name: str = "evoformer-small-pdb", notes: str = ""
) -> Path:
    """Ship a ``train_protein.py`` final model as ``name`` (fp16 weights, model card;
    ``notes`` are appended to the card's notes).

    The card's metrics are computed on the fp16-rounded weights that are shipped (so
    :func:`evaluate_pretrained` of the shipped name reproduces them).
    """
    import dspzoo.domains.protein  # noqa: F401
    from dspzoo.zoo import from_pretrained, load_config, load_extra
    from dspzoo.zoo.pretrained import ship_pretrained
    from dspzoo.zoo.shipped import round_to_shipped_precision

    extra = load_extra(final_dir)
    model = round_to_shipped_precision(from_pretrained(final_dir, expected_family="evoformer"))
    settings = extra["protein"]
    records = evaluate_samples(
        model,
        held_out_of(settings).samples,
        num_recycles=settings.get("num_recycles"),
        max_length=settings.get("eval_max_length", 256),
    )
    summary = summarise(records)
    config_name = json.loads((Path(final_dir) / "config.json").read_text()).get("config_name")
    config_name = config_name or "evoformer-small"
    _, config = load_config(final_dir)
    card = {
        "model": config_name,
        "data": (
            f"real PDB protein chains ({data_folder(settings.get('data', 'builtin')).name}, "
            f"split by entry: {len(settings['held_out'])} chains held out), crops of "
            f"{settings['crop_size']} residues, up to {settings['max_msa_rows']} MSA rows"
        ),
        "metrics": {
            "held_out_top_l5_long_range_precision": summary["precision"],
            "separation_baseline_precision": summary["baseline_separation"],
            "random_precision_contact_density": summary["contact_density"],
            "held_out_distogram_loss": summary["distogram_loss"],
        },
        "command": command,
        "eval": "dspzoo.domains.protein.training.evaluate_pretrained('evoformer-small-pdb')",
        "notes": (
            f"Distogram-only training on CPU; held-out chains: {', '.join(settings['held_out'])}. "
            f"Top-L/5 long-range (|i-j| >= 24) Cβ contact precision, mean over chains, beside a "
            f"sequence-separation-only predictor and the contact density (a random ranking's "
            f"expected precision). {config.num_blocks} blocks, c_m {config.c_m}, c_z "
            f"{config.c_z}; recycles {settings.get('num_recycles')}. {notes}"
        ).strip(),
        "held_out_chains": records,
    }
    return ship_pretrained(
        model, name, config_name=config_name, extra={"protein": settings}, card=card
    )

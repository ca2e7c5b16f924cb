r"""Predict a protein's distogram and contact map with DSP across the launched processes.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no scripts/predict_protein.py \
        --model-dir evoformer-small-pdb --fasta query.fasta --msa hits.a3m --out outputs/predict/query

--model-dir is a folder written by save_pretrained (train_protein.py's <output-dir>/final) or a
shipped model's name (dspzoo list --pretrained). --fasta holds the query (its first record;
--record picks another); each --msa (.a3m or .sto, repeatable) must have the query as its first
row. The first process writes <out>.npz (sequence, residue_index, distogram probabilities
[R, R, bins] as float16, bin boundaries, contact probabilities [R, R]) and <out>.png (the
contact map). Every process of an SP group computes the same gathered output; `python
scripts/predict_protein.py ...` runs it on one process.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspzoo.core.argparser import CommandParser
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.domains.protein.data import ProteinDataError, parse_fasta, parse_msa, sequence_to_ids
from dspzoo.domains.protein.dataset import collate, crop_and_sample
from dspzoo.domains.protein.metrics import Bins, contact_probabilities, write_contact_png


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="a folder written by save_pretrained, or a shipped model's name",
    )
    parser.add_argument("--fasta", required=True, help="FASTA file with the query sequence")
    parser.add_argument("--record", type=int, default=0, help="which FASTA record (default: 0)")
    parser.add_argument(
        "--msa", action="append", default=[], help="an .a3m or .sto alignment (repeatable)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output prefix for .npz and .png (default: outputs/predict/<id>)",
    )
    parser.add_argument("--sp", type=int, default=None, help="SP size (default: all processes)")
    parser.add_argument(
        "--sp-strategy", default="dsp", choices=sorted(STRATEGIES), help="(default: dsp)"
    )
    parser.add_argument(
        "--num-recycles", type=int, default=None, help="(default: the model's training setting)"
    )
    parser.add_argument(
        "--max-msa-rows", type=int, default=None, help="MSA rows used (default: all after dedup)"
    )
    return parser


def prediction_sample(sequence: str, msa_paths: list[str]) -> dict[str, Any]:
    """The uncropped sample of a query and its alignments (no structure: zero targets)."""
    from dspzoo.domains.protein.data import merge_msas

    aatype = sequence_to_ids(sequence, "query")
    msa = merge_msas(sequence, [parse_msa(p) for p in msa_paths])
    n = len(aatype)
    return {
        "name": "query",
        "aatype": aatype,
        "residue_index": np.arange(n, dtype=np.int64),
        "pseudo_beta": np.zeros((n, 3), dtype=np.float32),
        "pseudo_beta_mask": np.zeros(n, dtype=np.float32),
        "msa": msa.rows,
        "deletions": msa.deletions,
    }


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    sample: dict[str, Any],
    sp: Any = None,
    num_recycles: int | None = None,
    max_msa_rows: int | None = None,
) -> dict[str, np.ndarray]:
    """Distogram probabilities ``[R, R, bins]`` and contact probabilities ``[R, R]`` of one
    sample (the first ``max_msa_rows`` MSA rows). With ``sp`` the model runs sharded over the
    SP group (every rank passes the same sample) and returns the gathered output."""
    rows = max_msa_rows or len(sample["msa"])
    batch = collate([crop_and_sample(sample, None, rows, key=None)])
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    model.eval()
    logits = model(batch, sp=sp, num_recycles=num_recycles)["distogram_logits"].float().cpu()
    return {
        "distogram": torch.softmax(logits, -1)[0].numpy(),
        "contact_probs": contact_probabilities(logits, model.config)[0].numpy(),
        "boundaries": Bins.of(model.config).boundaries().numpy(),
    }


def main(argv: list[str] | None = None) -> dict[str, np.ndarray]:
    parser = build_parser()
    args = parser.parse_args(argv)
    import dspzoo.domains.protein  # noqa: F401  (registers the evoformer family)
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.zoo import from_pretrained, load_extra

    try:
        description, sequence = parse_fasta(args.fasta)[args.record]
        sample = prediction_sample(sequence, args.msa)
    except IndexError:
        parser.error(f"--record {args.record}: {args.fasta} has fewer records")
    except ProteinDataError as exc:
        parser.error(str(exc))
    world = int(os.environ.get("WORLD_SIZE", 1))
    accelerator, mesh, sp = setup_accelerate(sp_size=args.sp or world, strategy=args.sp_strategy)
    try:
        model = from_pretrained(args.model_dir, expected_family="evoformer")
        settings = load_extra(args.model_dir).get("protein", {})
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    model = model.to(accelerator.device)
    recycles = args.num_recycles if args.num_recycles is not None else settings.get("num_recycles")
    result = predict(model, sample, sp if mesh.sp_size > 1 else None, recycles, args.max_msa_rows)
    if mesh.is_main:
        name = description.split()[0] if description else "query"
        out = Path(args.out) if args.out else Path("outputs/predict") / name
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            out.with_suffix(".npz"),
            sequence=np.array(sequence),
            residue_index=sample["residue_index"],
            distogram=result["distogram"].astype(np.float16),
            boundaries=result["boundaries"],
            contact_probs=result["contact_probs"],
        )
        write_contact_png(
            out.with_suffix(".png"),
            torch.from_numpy(result["contact_probs"]),
            title=f"{name} ({len(sequence)} residues, SP {mesh.sp_size})",
        )
        print(f"wrote {out.with_suffix('.npz')} and {out.with_suffix('.png')}")
    accelerator.wait_for_everyone()
    return result


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "predict_protein.py"))

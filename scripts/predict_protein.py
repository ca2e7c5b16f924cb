r"""Predict a protein's distogram and contact map with DSP across the launched processes.

    dspzoo predict evoformer-small-pdb --fasta tests/data/protein/2q2k_A.fasta --out q   # shipped data
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        -m dspzoo predict evoformer-small-pdb --fasta query.fasta --msa hits.a3m --out outputs/predict/query

The model (``--model-dir`` when the script runs as ``python scripts/predict_protein.py``) is
a folder written by save_pretrained (train_protein.py's <output-dir>/final) or a shipped model's
name (dspzoo list --pretrained). --fasta holds the query (its first record;
--record picks another); each --msa (.a3m or .sto, repeatable) must have the query as its first
row. The first process writes <out>.npz (sequence, residue_index, distogram probabilities
[R, R, bins] as float16, bin boundaries, contact probabilities [R, R]) and <out>.png (the
contact map). Every process of an SP group computes the same gathered output; `python
scripts/predict_protein.py ...` runs it on one process. The command line of
:func:`dspzoo.zoo.inference.predict_protein` (the Python API).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch

from dspzoo.core.argparser import CommandParser
from dspzoo.domains.protein.data import ProteinDataError, parse_fasta
from dspzoo.domains.protein.metrics import write_contact_png
from dspzoo.domains.protein.predict import predict, prediction_sample  # noqa: F401  (were here)


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
        "--sp-strategy",
        default="dsp",
        choices=["dsp"],
        help="sequence-parallel strategy: the Evoformer runs under dsp only (its MSA and pair "
        "activations are planned together)",
    )
    parser.add_argument(
        "--num-recycles",
        type=int,
        default=None,
        help="times the trunk's output is fed back through it (default: the model's training "
        "setting)",
    )
    parser.add_argument(
        "--max-msa-rows", type=int, default=None, help="MSA rows used (default: all after dedup)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, np.ndarray]:
    parser = build_parser()
    args = parser.parse_args(argv)
    from dspzoo.core.accelerate import setup_accelerate
    from dspzoo.zoo import inference

    try:
        description, sequence = parse_fasta(args.fasta)[args.record]
    except IndexError:
        parser.error(f"--record {args.record}: {args.fasta} has fewer records")
    except ProteinDataError as exc:
        parser.error(str(exc))
    world = int(os.environ.get("WORLD_SIZE", 1))
    accelerator, mesh, sp = setup_accelerate(sp_size=args.sp or world, strategy=args.sp_strategy)
    try:
        model = inference.load(args.model_dir, "evoformer", accelerator.device)
        result = inference.predict_protein(
            model,
            sequence,
            args.msa,
            sp=sp,
            num_recycles=args.num_recycles,
            max_msa_rows=args.max_msa_rows,
        )
    except (FileNotFoundError, ValueError) as exc:  # ProteinDataError is a ValueError
        parser.error(str(exc))
    if mesh.is_main:
        name = description.split()[0] if description else "query"
        out = Path(args.out) if args.out else Path("outputs/predict") / name
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            out.with_suffix(".npz"),
            sequence=np.array(sequence),
            residue_index=result.residue_index,
            distogram=result.distogram.astype(np.float16),
            boundaries=result.boundaries,
            contact_probs=result.contact_probs,
        )
        write_contact_png(
            out.with_suffix(".png"),
            torch.from_numpy(result.contact_probs),
            title=f"{name} ({len(sequence)} residues, SP {mesh.sp_size})",
        )
        print(f"wrote {out.with_suffix('.npz')} and {out.with_suffix('.png')}")
    accelerator.wait_for_everyone()
    return {
        "distogram": result.distogram,
        "contact_probs": result.contact_probs,
        "boundaries": result.boundaries,
    }


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "predict_protein.py"))

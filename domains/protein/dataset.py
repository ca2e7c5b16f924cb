"""A dataset over a folder of protein structures (with optional MSAs), keyed crops and MSA
sampling, and the collate that pads samples into the model's batch.

Folder layout::

    <folder>/<entry>.cif | .pdb | .ent   (optionally .gz; every protein chain is one sample)
    <folder>/alignments/<entry>_<chain>/*.a3m | *.sto   (optional; row 0 must be the chain)

A sample (:meth:`ProteinDataset.__getitem__`) is the whole chain as NumPy arrays: its
``aatype``, ``residue_index``, targets, and its merged, deduplicated MSA (``msa``,
``deletions`` ``[S, L]``). Training randomness — which contiguous crop of ``crop_size``
residues and which MSA rows — is drawn in :func:`crop_and_sample` from a generator keyed by
``(seed, step, global sample index)`` (:mod:`dspzoo.core.parallel.rng`), so it is the same on every rank
of an SP group, independent of the dp × sp layout, and exact after a resume. :func:`collate`
builds the contract's feature tensors and pads them to a common ``R`` and ``S``.

The train/held-out split is by entry (both chains of a dimer land on the same side): an entry
is held out when a hash of ``(split_seed, entry)`` falls below ``held_out_fraction``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dspzoo.core.parallel.rng import keyed_generator, mix_key

from ...core.errors import UsageError
from .data import (
    MSA,
    STRUCTURE_SUFFIXES,
    Chain,
    ProteinDataError,
    entry_of,
    merge_msas,
    msa_feat,
    parse_msa,
    parse_structure,
    target_feat,
)

logger = logging.getLogger(__name__)

BUILTIN_DATA = Path(__file__).parent / "data_files" / "pdb_chains"
"""The real chains shipped with the package (see ``data_files/README.md``)."""

Sample = dict[str, np.ndarray | str]


def structure_files(folder: str | os.PathLike) -> list[Path]:
    """Structure files directly inside ``folder``, sorted by name; a clear error if none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProteinDataError(f"{folder}: not a folder of structures")
    found = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.name.lower().removesuffix(".gz").endswith(STRUCTURE_SUFFIXES)
    )
    if not found:
        raise ProteinDataError(
            f"{folder}: no structure files (.cif/.mmcif/.pdb/.ent, optionally .gz)"
        )
    return found


def is_held_out(entry: str, fraction: float, split_seed: int = 0) -> bool:
    """Whether ``entry`` belongs to the held-out split (a pure function of its name)."""
    return (mix_key(split_seed, entry.lower(), "held-out") % 10_000) < fraction * 10_000


def alignment_files(folder: Path, chain_name: str) -> list[Path]:
    """The ``.a3m``/``.sto`` files of ``<folder>/alignments/<chain_name>/``, sorted by name."""
    directory = folder / "alignments" / chain_name
    if not directory.is_dir():
        return []
    suffixes = (".a3m", ".sto", ".stockholm")
    return sorted(
        p for p in directory.iterdir() if p.name.lower().removesuffix(".gz").endswith(suffixes)
    )


def chain_sample(chain: Chain, msas: Sequence[MSA] = ()) -> Sample:
    """The uncropped sample of one chain: sequence, targets and its merged, deduplicated MSA."""
    msa = merge_msas(chain.sequence, msas)
    return {
        "name": chain.name,
        "aatype": chain.aatype,
        "residue_index": chain.residue_index,
        "pseudo_beta": chain.pseudo_beta,
        "pseudo_beta_mask": chain.pseudo_beta_mask,
        "msa": msa.rows,
        "deletions": msa.deletions,
    }


class ProteinDataset(Dataset):
    """Every protein chain of a folder of structures, on one side of the entry split.

    Args:
        folder: the structures folder (layout in the module docstring).
        split: ``"train"``, ``"held_out"`` or ``"all"``.
        held_out_fraction, split_seed: the entry split (:func:`is_held_out`).
        min_observed: chains with fewer observed residues (with a pseudo-β atom) are skipped.
        max_length: chains with longer SEQRES are skipped (``None``: keep all).
        held_out_entries: if given, exactly these entries are held out (replaces the hash).

    Parsing errors raise :class:`~dspzoo.domains.protein.data.ProteinDataError` naming the file.
    The files of this split are parsed once, at construction.
    """

    def __init__(
        self,
        folder: str | os.PathLike = BUILTIN_DATA,
        split: str = "train",
        held_out_fraction: float = 0.1,
        split_seed: int = 0,
        min_observed: int = 16,
        max_length: int | None = None,
        held_out_entries: Sequence[str] | None = None,
    ) -> None:
        if split not in ("train", "held_out", "all"):
            raise UsageError(f"split must be 'train', 'held_out' or 'all', got {split!r}")
        self.folder = Path(folder)
        self.samples: list[Sample] = []
        for path in structure_files(self.folder):
            entry = entry_of(path)
            if held_out_entries:
                held = entry.lower() in {e.lower() for e in held_out_entries}
            else:
                held = is_held_out(entry, held_out_fraction, split_seed)
            if split == "train" and held or split == "held_out" and not held:
                continue
            for chain in parse_structure(path):
                if chain.pseudo_beta_mask.sum() < min_observed:
                    continue
                if max_length is not None and len(chain) > max_length:
                    continue
                msas = [parse_msa(p) for p in alignment_files(self.folder, chain.name)]
                self.samples.append(chain_sample(chain, msas))
        if not self.samples:
            raise ProteinDataError(
                f"{self.folder}: no chains in the {split!r} split (held-out fraction "
                f"{held_out_fraction}, split seed {split_seed}, min observed {min_observed})"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]

    @property
    def names(self) -> list[str]:
        return [str(s["name"]) for s in self.samples]


def keep_as_list(samples: list[Sample]) -> list[Sample]:
    """Collate for the loader: keep the variable-length samples as a list (cropped and padded
    in the training step with keyed draws, :func:`crop_and_sample` and :func:`collate`)."""
    return list(samples)


def crop_start(length: int, crop_size: int, gen: torch.Generator) -> int:
    """Start of a contiguous crop of ``min(length, crop_size)`` residues, uniform over the
    possible starts."""
    if length <= crop_size:
        return 0
    return int(torch.randint(0, length - crop_size + 1, (1,), generator=gen))


def sample_msa_rows(depth: int, max_rows: int, gen: torch.Generator) -> np.ndarray:
    """Row indices of an MSA subsample: the query (row 0) and up to ``max_rows - 1`` other rows
    drawn without replacement, in random order (AF2's MSA sampling, without clustering)."""
    if max_rows < 1:
        raise UsageError(f"max_rows must be >= 1, got {max_rows}")
    rest = torch.randperm(depth - 1, generator=gen)[: max_rows - 1].numpy() + 1
    return np.concatenate([[0], rest]).astype(np.int64)


def crop_and_sample(
    sample: Sample, crop_size: int | None, max_msa_rows: int, key: int | None
) -> Sample:
    """A crop of ``sample``'s residues and a subsample of its MSA rows.

    ``key`` (e.g. ``mix_key(seed, step, sample_index, "crop")``) seeds the draws; ``None``:
    no randomness — the first ``crop_size`` residues and the first ``max_msa_rows`` rows. The
    MSA column profile and deletion mean are taken over the whole MSA (cropped columns) before
    the rows are subsampled, and travel in ``profile``/``deletion_mean``.
    """
    length = len(sample["aatype"])
    crop = length if crop_size is None else min(crop_size, length)
    msa, deletions = sample["msa"], sample["deletions"]
    if key is None:
        start, rows = 0, np.arange(min(max_msa_rows, msa.shape[0]))
    else:
        gen = keyed_generator(key)
        start = crop_start(length, crop, gen)
        rows = sample_msa_rows(msa.shape[0], max_msa_rows, gen)
    cols = slice(start, start + crop)
    out = {k: v[cols] for k, v in sample.items() if k not in ("name", "msa", "deletions")}
    out["name"] = sample["name"]
    out["msa_full"] = msa[:, cols]
    out["deletions_full"] = deletions[:, cols]
    out["msa"] = msa[rows][:, cols]
    out["deletions"] = deletions[rows][:, cols]
    return out


def features(sample: Sample) -> dict[str, np.ndarray]:
    """The contract's unpadded features of one (cropped) sample; profile and deletion mean over
    the sample's whole MSA when it carries ``msa_full``."""
    aatype = np.asarray(sample["aatype"])
    full_rows = sample.get("msa_full", sample["msa"])
    full_dels = sample.get("deletions_full", sample["deletions"])
    return {
        "aatype": aatype,
        "target_feat": target_feat(aatype),
        "msa_feat": msa_feat(sample["msa"], sample["deletions"], full_rows, full_dels),
        "residue_index": np.asarray(sample["residue_index"]),
        "pseudo_beta": np.asarray(sample["pseudo_beta"], dtype=np.float32),
        "pseudo_beta_mask": np.asarray(sample["pseudo_beta_mask"], dtype=np.float32),
    }


def collate(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Stack (cropped) samples into the model batch, padded to the longest ``R`` and deepest
    ``S``: ``aatype`` [B, R] (padding 20 = X), ``target_feat`` [B, R, 22], ``msa_feat``
    [B, S, R, 49], ``residue_index`` [B, R], ``seq_mask`` [B, R], ``msa_mask`` [B, S, R],
    ``pseudo_beta`` [B, R, 3], ``pseudo_beta_mask`` [B, R]; padding is zero (masks 0)."""
    feats = [features(s) for s in samples]
    b = len(feats)
    r = max(len(f["aatype"]) for f in feats)
    s = max(f["msa_feat"].shape[0] for f in feats)
    batch = {
        "aatype": torch.full((b, r), 20, dtype=torch.long),
        "target_feat": torch.zeros(b, r, 22),
        "msa_feat": torch.zeros(b, s, r, 49),
        "residue_index": torch.zeros(b, r, dtype=torch.long),
        "seq_mask": torch.zeros(b, r),
        "msa_mask": torch.zeros(b, s, r),
        "pseudo_beta": torch.zeros(b, r, 3),
        "pseudo_beta_mask": torch.zeros(b, r),
    }
    for i, f in enumerate(feats):
        n, depth = len(f["aatype"]), f["msa_feat"].shape[0]
        batch["aatype"][i, :n] = torch.from_numpy(f["aatype"])
        batch["target_feat"][i, :n] = torch.from_numpy(f["target_feat"])
        batch["msa_feat"][i, :depth, :n] = torch.from_numpy(f["msa_feat"])
        batch["residue_index"][i, :n] = torch.from_numpy(f["residue_index"])
        batch["seq_mask"][i, :n] = 1.0
        batch["msa_mask"][i, :depth, :n] = 1.0
        batch["pseudo_beta"][i, :n] = torch.from_numpy(f["pseudo_beta"])
        batch["pseudo_beta_mask"][i, :n] = torch.from_numpy(f["pseudo_beta_mask"])
    return batch


def training_batch(
    samples: Sequence[Sample],
    seed: int,
    step: int,
    sample_indices: Sequence[int],
    crop_size: int,
    max_msa_rows: int,
) -> dict[str, torch.Tensor]:
    """The batch of one training step: each sample cropped and MSA-subsampled with draws keyed
    by ``(seed, step, global sample index)``, then collated."""
    cropped = [
        crop_and_sample(s, crop_size, max_msa_rows, mix_key(seed, step, int(i), "protein-crop"))
        for s, i in zip(samples, sample_indices)
    ]
    return collate(cropped)

"""Predicting a protein's distogram and contact map from its sequence and alignments.

:func:`prediction_sample` turns a query sequence and its MSAs into the model's (uncropped)
sample; :func:`predict` runs a model on it, on one process or sharded over an SP group.
``dspzoo.zoo.inference.predict_protein`` and ``scripts/predict_protein.py`` call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .data import merge_msas, parse_msa, sequence_to_ids
from .dataset import collate, crop_and_sample
from .metrics import Bins, contact_probabilities


def prediction_sample(sequence: str, msa_paths: Sequence[str]) -> dict[str, Any]:
    """The uncropped sample of a query and its alignments (no structure: zero targets).

    Each alignment (``.a3m`` or ``.sto``) must have the query as its first row; a bad sequence
    or alignment raises :class:`~dspzoo.domains.protein.data.ProteinDataError` (a
    ``ValueError``) naming it.
    """
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
    """Distogram probabilities ``[R, R, bins]``, contact probabilities ``[R, R]`` and the bin
    boundaries ``[bins - 1]`` of one sample (its first ``max_msa_rows`` MSA rows). With ``sp``
    the model runs sharded over the SP group (every rank passes the same sample) and every rank
    returns the gathered output."""
    rows = max_msa_rows or len(sample["msa"])
    batch = collate([crop_and_sample(sample, None, rows, key=None)])
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    model.eval()
    out = model(batch, sp=sp, num_recycles=num_recycles, outputs=("distogram_logits",))
    logits = out["distogram_logits"].float().cpu()
    return {
        "distogram": torch.softmax(logits, -1)[0].numpy(),
        "contact_probs": contact_probabilities(logits, model.config)[0].numpy(),
        "boundaries": Bins.of(model.config).boundaries().numpy(),
    }

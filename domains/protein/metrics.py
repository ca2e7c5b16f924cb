"""Distogram loss, long-range contact precision, and contact-map figures.

Distogram bins follow AlphaFold 2: ``distogram_bins - 1`` boundaries evenly spaced from
``first_break`` to ``last_break`` (2.3125 … 21.6875 Å for 64 bins, 0.3125 Å apart); bin 0 is
below the first boundary, the last bin above the last one. A pair's target bin is the number
of boundaries below its Cβ–Cβ distance (compared squared, as AF2 does).

Contacts: Cβ (Cα for glycine) closer than 8 Å. The predicted contact probability of a pair is
the probability mass of the bins lying entirely below 8 Å (upper boundary ≤ 8 Å: bins 0..18,
distance < 7.9375 Å, for AF2's bins). Top-L/5 long-range precision: among pairs with
``|i − j| ≥ 24`` (residue index) whose two residues both have a known pseudo-β position, take
the ``L // 5`` (at least 1) most probable; the precision is the share of true contacts
among them (``L``: the real residues of the sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Bins:
    """Distogram binning (AF2 defaults)."""

    num_bins: int = 64
    first_break: float = 2.3125
    last_break: float = 21.6875

    @classmethod
    def of(cls, config: Any | None) -> Bins:
        """From a model config with ``distogram_bins``/``first_break``/``last_break`` (or None)."""
        if config is None:
            return cls()
        return cls(
            int(getattr(config, "distogram_bins", cls.num_bins)),
            float(getattr(config, "first_break", cls.first_break)),
            float(getattr(config, "last_break", cls.last_break)),
        )

    def boundaries(self, device: Any = None) -> torch.Tensor:
        """``[num_bins - 1]`` boundaries in Å."""
        return torch.linspace(self.first_break, self.last_break, self.num_bins - 1, device=device)


def pairwise_distances(positions: torch.Tensor) -> torch.Tensor:
    """``[B, R, 3]`` → ``[B, R, R]`` Euclidean distances."""
    diff = positions[..., :, None, :] - positions[..., None, :, :]
    return diff.pow(2).sum(-1).sqrt()


def distogram_targets(pseudo_beta: torch.Tensor, bins: Bins) -> torch.Tensor:
    """``[B, R, R]`` long target bins: the number of boundaries below each distance."""
    diff = pseudo_beta[..., :, None, :] - pseudo_beta[..., None, :, :]
    d2 = diff.pow(2).sum(-1, keepdim=True)
    return (d2 > bins.boundaries(pseudo_beta.device).pow(2)).sum(-1)


def distogram_loss(
    logits: torch.Tensor,
    pseudo_beta: torch.Tensor,
    pseudo_beta_mask: torch.Tensor,
    config: Any | None = None,
) -> torch.Tensor:
    """Distogram cross-entropy: per sample the mean over pairs of observed residues, then the
    mean over the batch (AF2).

    Args:
        logits: ``[B, R, R, num_bins]``.
        pseudo_beta: ``[B, R, 3]`` Å.
        pseudo_beta_mask: ``[B, R]`` (1 where the pseudo-β position is known).
        config: the model config (bins; default AF2's).

    Returns a scalar (float32 or wider).
    """
    bins = Bins.of(config)
    if logits.shape[-1] != bins.num_bins:
        raise ValueError(
            f"distogram_loss: logits have {logits.shape[-1]} bins, the config {bins.num_bins}"
        )
    targets = distogram_targets(pseudo_beta.float(), bins)
    nll = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none").view(
        targets.shape
    )
    pair_mask = pseudo_beta_mask[..., :, None] * pseudo_beta_mask[..., None, :]
    per_sample = (nll * pair_mask).sum((-2, -1)) / (1e-6 + pair_mask.sum((-2, -1)))
    return per_sample.mean()


def contact_probabilities(
    logits: torch.Tensor, config: Any | None = None, threshold: float = 8.0
) -> torch.Tensor:
    """``[B, R, R, bins]`` → ``[B, R, R]``: the mass of the bins entirely below ``threshold``."""
    bins = Bins.of(config)
    below = int((bins.boundaries() <= threshold).sum())  # bins 0..below-1 end at or below it
    return torch.softmax(logits.float(), -1)[..., :below].sum(-1)


def contact_precision_from_probs(
    probs: torch.Tensor,
    pseudo_beta: torch.Tensor,
    pseudo_beta_mask: torch.Tensor,
    residue_index: torch.Tensor | None = None,
    seq_mask: torch.Tensor | None = None,
    min_separation: int = 24,
    top_fraction: float = 0.2,
    threshold: float = 8.0,
) -> torch.Tensor:
    """Top-``L·top_fraction`` precision of ``|i−j| ≥ min_separation`` contacts per sample ``[B]``
    for contact probabilities ``probs`` ``[B, R, R]`` (see the module docstring).

    A sample without any candidate pair gets NaN.
    """
    b, r = probs.shape[:2]
    device = probs.device
    if residue_index is None:
        residue_index = torch.arange(r, device=device).expand(b, r)
    if seq_mask is None:
        seq_mask = torch.ones(b, r, device=device)
    true = pairwise_distances(pseudo_beta.float()) < threshold
    sep = (residue_index[:, :, None] - residue_index[:, None, :]).abs()
    known = (pseudo_beta_mask[:, :, None] * pseudo_beta_mask[:, None, :]) > 0
    upper = torch.ones(r, r, dtype=torch.bool, device=device).triu(1)
    candidates = known & (sep >= min_separation) & upper
    out = torch.full((b,), float("nan"))
    for i in range(b):
        k = max(1, int(float(seq_mask[i].sum()) * top_fraction))
        scores = probs[i][candidates[i]]
        if scores.numel() == 0:
            continue
        top = torch.topk(scores.float(), min(k, scores.numel())).indices
        out[i] = true[i][candidates[i]][top].float().mean().cpu()
    return out


def contact_precision(
    logits: torch.Tensor,
    pseudo_beta: torch.Tensor,
    pseudo_beta_mask: torch.Tensor,
    residue_index: torch.Tensor | None = None,
    seq_mask: torch.Tensor | None = None,
    config: Any | None = None,
    min_separation: int = 24,
    top_fraction: float = 0.2,
    threshold: float = 8.0,
) -> torch.Tensor:
    """Top-L/5 long-range contact precision per sample ``[B]`` from distogram ``logits``
    ``[B, R, R, bins]`` (see the module docstring)."""
    probs = contact_probabilities(logits, config, threshold)
    return contact_precision_from_probs(
        probs, pseudo_beta, pseudo_beta_mask, residue_index, seq_mask,
        min_separation, top_fraction, threshold,
    )  # fmt: skip


def separation_baseline(residue_index: torch.Tensor) -> torch.Tensor:
    """Contact "probabilities" of a predictor that knows only the sequence separation:
    ``1 / (1 + |i − j|)`` ``[B, R, R]`` (nearer in sequence → more likely in contact)."""
    sep = (residue_index[:, :, None] - residue_index[:, None, :]).abs().float()
    return 1.0 / (1.0 + sep)


def write_contact_png(
    path: str | Path,
    probs: torch.Tensor,
    pseudo_beta: torch.Tensor | None = None,
    pseudo_beta_mask: torch.Tensor | None = None,
    title: str = "",
    threshold: float = 8.0,
) -> Path:
    """One figure: predicted contact probability ``[R, R]`` beside the true contact map (Cβ <
    ``threshold`` Å; unobserved pairs red), or alone when no structure is given. Written with
    matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = 1 if pseudo_beta is None else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 4.2), constrained_layout=True)
    axes = np.atleast_1d(axes)
    im = axes[0].imshow(probs.float().numpy(), cmap="Blues", vmin=0, vmax=1, origin="upper")
    axes[0].set_title(f"predicted P(Cβ–Cβ < {threshold:g} Å)")
    fig.colorbar(im, ax=axes[0], shrink=0.8)
    if pseudo_beta is not None:
        if pseudo_beta_mask is None:
            pseudo_beta_mask = torch.ones(pseudo_beta.shape[0])
        true = pairwise_distances(pseudo_beta.float()[None])[0] < threshold
        known = (pseudo_beta_mask[:, None] * pseudo_beta_mask[None, :]).numpy() > 0
        true_map = np.where(known, true.float().numpy(), np.nan)
        cmap = plt.get_cmap("Greys").with_extremes(bad="#f2c6c6")
        axes[1].imshow(true_map, cmap=cmap, vmin=0, vmax=1, origin="upper")
        axes[1].set_title("true contacts (red: unobserved)")
    for ax in axes:
        ax.set_xlabel("residue j")
        ax.set_ylabel("residue i")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

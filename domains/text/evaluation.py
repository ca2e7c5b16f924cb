"""The byte LM's model-card figure: bits per byte on held-out windows, one process.

The built-in corpus is the running Python's standard library, so it differs slightly between
Python versions; :func:`corpus_digest` fingerprints it, and a shipped model's card records the
digest its figure was measured on.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from dspzoo.core import SeqParallel

from .data import ByteWindows, resolve_data


def corpus_digest(path: str | Path) -> str:
    """SHA-256 (hex, first 16 characters) of a byte file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


@torch.no_grad()
def heldout_bits_per_byte(
    model: torch.nn.Module,
    seq_len: int,
    data: str = "stdlib",
    val_fraction: float = 0.05,
    windows: int = 32,
    batch: int = 8,
) -> float:
    """Mean next-byte cross-entropy in bits over the first ``windows`` held-out windows.

    The same windows and split as ``--eval-every`` in training (``--val-fraction`` at the end
    of the data, ``seq_len``-byte windows). The windows go to the model's device.
    """
    val = ByteWindows(resolve_data(data), seq_len, "val", val_fraction)
    count = min(windows, len(val))
    nats, total = 0.0, 0
    device = next(model.parameters()).device
    model.eval()
    for first in range(0, count, batch):
        items = [val[i] for i in range(first, min(first + batch, count))]
        tokens = torch.stack([it["tokens"] for it in items]).to(device)
        targets = torch.stack([it["targets"] for it in items]).to(device)
        logits = model(tokens, sp=SeqParallel())
        nats += F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")
        total += targets.numel()
    return float(nats) / total / math.log(2)

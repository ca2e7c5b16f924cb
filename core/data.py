"""SP-aware data loading: one batch per SP group, different batches across DP groups.

Built on Accelerate's :func:`accelerate.data_loader.prepare_data_loader` with the *dp* size and
rank (not the world's): a seeded sampler gives every rank the same permutation, Accelerate's
batch sharding then hands each DP group its own batches, so every rank of an SP group sees the
same batch in the same order. Worker processes are seeded from a generator that is identical
inside an SP group and distinct across DP groups (in every epoch), so random augmentation
agrees inside a group and differs across groups.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Dataset

from .mesh import SPMesh, mix_dp_rank, sp_generator


def _seed_worker(worker_id: int, dp_rank: int) -> None:
    """Seed torch, numpy and ``random`` in a worker from its base seed and the DP rank.

    The base seed is drawn from the loader's generator, which Accelerate's seedable sampler
    reseeds with ``seed + epoch`` on every rank alike; mixing in the DP rank keeps the workers
    of different DP groups apart while the ranks of one SP group stay identical.
    """
    seed = mix_dp_rank(torch.initial_seed(), dp_rank)
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))
    random.seed(seed)


def sp_dataloader(
    dataset: Dataset,
    mesh: SPMesh,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    device: torch.device | None = None,
) -> DataLoader:
    """A dataloader giving identical batches inside an SP group and different ones across DP.

    Args:
        dataset: any map-style dataset.
        mesh: the dp × sp mesh (``batch_size`` is per DP group).
        shuffle: reshuffle each epoch (call ``loader.set_epoch(epoch)``).
        seed: shuffling and worker seed, shared by all ranks.
        drop_last: drop the incomplete last batch (keeps all DP groups in step).
        device: if given, batches are moved there.

    Do not pass the result (or the dataset) through ``accelerator.prepare``: that would shard
    it over the whole world, giving each rank of an SP group a different sample.
    """
    if len(dataset) < batch_size * mesh.dp_size and drop_last:  # type: ignore[arg-type]
        raise ValueError(
            f"dataset of {len(dataset)} samples is too small for batch_size={batch_size} over "  # type: ignore[arg-type]
            f"{mesh.dp_size} data-parallel groups with drop_last=True"
        )
    base = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_fn,
        worker_init_fn=partial(_seed_worker, dp_rank=mesh.dp_rank),
        generator=sp_generator(mesh, seed),
    )
    return prepare_data_loader(
        base,
        device=device,
        num_processes=mesh.dp_size,
        process_index=mesh.dp_rank,
        put_on_device=device is not None,
        rng_types=[],
        use_seedable_sampler=shuffle,
        data_seed=seed,
        even_batches=True,
    )

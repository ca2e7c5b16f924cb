"""SP-aware data loading: one batch per SP group, different batches across DP groups.

The sample order is a function of ``(seed, epoch)`` alone and is cut into *global* batches of
``batch_size × dp_size`` samples; DP group ``d`` takes the ``d``-th contiguous share of each
global batch and every rank of an SP group loads exactly that share. So

* the ranks of an SP group see the same samples in the same order,
* DP groups see disjoint samples,
* the union over DP groups of step ``k``'s batches is the same global batch for every
  dp × sp layout with the same global batch size, and
* a run resumed at step ``k`` (:meth:`SPBatchSampler.set_step`) continues with step ``k``'s
  batch, at any layout, without replaying the epoch.

Worker processes are seeded from a generator that is identical inside an SP group and distinct
across DP groups (every epoch), so in-worker augmentation agrees inside a group. For results
independent of the layout, datasets should be pure functions of the sample index (both
built-in video datasets are) and training draws should be keyed (:mod:`dspzoo.core.parallel.rng`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .errors import UsageError
from .parallel.mesh import SPMesh, mix_dp_rank, sp_generator
from .parallel.rng import keyed_generator, mix_key


class SPBatchSampler(Sampler[list[int]]):
    """This DP group's share of the global batches of one epoch.

    Args:
        num_samples: dataset length.
        batch_size: samples per step per DP group (the global batch is ``batch_size·dp_size``).
        dp_size, dp_rank: the data-parallel coordinates of this rank.
        shuffle: permute the samples each epoch with a generator keyed by ``(seed, epoch)``.
        seed: the shuffling seed, shared by all ranks.

    An epoch has ``num_samples // global_batch`` steps (the incomplete last global batch is
    dropped, so all DP groups stay in step). Iterating yields the batches from the current
    position to the end of the current epoch; :meth:`set_epoch` and :meth:`set_step` move the
    position.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is out of range for dp_size {dp_size}")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.dp_size, self.dp_rank = int(dp_size), int(dp_rank)
        self.global_batch = self.batch_size * self.dp_size
        self.steps_per_epoch = self.num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"dataset of {num_samples} samples is too small for one global batch of "
                f"{self.global_batch} (batch_size={batch_size} × {dp_size} data-parallel groups)"
            )
        self.shuffle, self.seed = shuffle, int(seed)
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Start at the first step of ``epoch``."""
        self.epoch, self.start = int(epoch), 0

    def set_step(self, step: int) -> None:
        """Start at global step ``step`` (counted from the start of training)."""
        self.epoch, self.start = divmod(int(step), self.steps_per_epoch)

    def order(self, epoch: int) -> list[int]:
        """The global sample order of ``epoch`` (the same on every rank and layout)."""
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = keyed_generator(mix_key(self.seed, epoch, "data-order"))
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for step in range(self.start, self.steps_per_epoch):
            first = step * self.global_batch + self.dp_rank * self.batch_size
            yield order[first : first + self.batch_size]

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start


def _seed_worker(worker_id: int, dp_rank: int) -> None:
    """Seed torch, numpy and ``random`` in a worker from its base seed and the DP rank.

    The base seed is drawn from the loader's generator, identical on the ranks of an SP group;
    mixing in the DP rank keeps the workers of different DP groups apart.
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
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    device: torch.device | None = None,
) -> DataLoader:
    """A dataloader giving identical batches inside an SP group and different ones across DP.

    Args:
        dataset: any map-style dataset.
        mesh: the dp × sp mesh.
        batch_size: samples per step per DP group; the global batch is ``batch_size·dp_size``.
        shuffle: reshuffle each epoch (``loader.set_epoch(epoch)``), from ``(seed, epoch)``.
        seed: shuffling and worker seed, shared by all ranks.
        device: if given, tensors in each batch are moved there.

    The returned loader has ``set_epoch(epoch)`` and ``set_step(global_step)`` (resume) and its
    :class:`SPBatchSampler` as ``loader.batch_sampler``. Do not pass it (or the dataset) through
    ``accelerator.prepare``: that would shard it over the whole world, giving each rank of an
    SP group a different sample.
    """
    sampler = SPBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size,
        mesh.dp_size,
        mesh.dp_rank,
        shuffle=shuffle,
        seed=seed,
    )
    return SPDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        worker_init_fn=partial(_seed_worker, dp_rank=mesh.dp_rank),
        generator=sp_generator(mesh, seed),
        device=device,
    )


class SPDataLoader(DataLoader):
    """A ``DataLoader`` over an :class:`SPBatchSampler` that can move batches to a device."""

    def __init__(self, *args: Any, device: torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` from its first step."""
        self.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]

    def set_step(self, step: int) -> None:
        """Iterate from global step ``step`` to the end of its epoch."""
        self.batch_sampler.set_step(step)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            yield batch if self.device is None else _to_device(batch, self.device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch

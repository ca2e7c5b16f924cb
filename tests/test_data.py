"""SP-aware dataloader: equal batches inside an SP group, different across DP groups."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from dspzoo.core import build_mesh, seed_everything, sp_dataloader
from dspzoo.core.testing import run_distributed


class Numbers(Dataset):
    """Sample i is i plus a random 'augmentation' drawn from the worker's RNG."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()])


def _batches(rank: int, world: int, sp_size: int, num_workers: int) -> dict:
    mesh = build_mesh(sp_size)
    seed_everything(mesh, 7)
    loader = sp_dataloader(Numbers(), mesh, batch_size=4, seed=3, num_workers=num_workers)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(torch.cat([b for b in loader]))
    return {"dp": mesh.dp_rank, "epochs": epochs, "noise": torch.rand(3)}


def _check(results: list[dict], num_batches: int) -> None:
    by_dp: dict[int, list[dict]] = {}
    for r in results:
        by_dp.setdefault(r["dp"], []).append(r)
    for group in by_dp.values():  # identical inside an SP group: samples, augmentation, RNG
        for other in group[1:]:
            for a, b in zip(group[0]["epochs"], other["epochs"], strict=True):
                assert torch.equal(a, b)
            assert torch.equal(group[0]["noise"], other["noise"])
    firsts = [g[0] for g in by_dp.values()]
    ids = [set(r["epochs"][0][:, 0].tolist()) for r in firsts]
    for i in range(len(ids)):  # DP groups see disjoint samples
        for j in range(i + 1, len(ids)):
            assert not ids[i] & ids[j]
    if len(firsts) > 1:
        assert not torch.equal(firsts[0]["noise"], firsts[1]["noise"])
        for a, b in zip(firsts[0]["epochs"], firsts[1]["epochs"], strict=True):
            assert not torch.equal(a[:, 1], b[:, 1])  # augmentation streams differ, every epoch
    for r in firsts:  # each epoch reshuffles
        assert not torch.equal(r["epochs"][0], r["epochs"][1])
        assert r["epochs"][0].shape[0] == num_batches * 4


def test_dataloader_dp2_sp2() -> None:
    _check(run_distributed(_batches, 4, 2, 0), num_batches=64 // 4 // 2)


def test_dataloader_with_workers_sp2() -> None:
    _check(run_distributed(_batches, 2, 2, 2), num_batches=64 // 4)


def test_dataloader_workers_differ_across_dp_groups() -> None:
    _check(run_distributed(_batches, 2, 1, 2), num_batches=64 // 4 // 2)


def _global_batches(sampler_for_dp, dp: int, steps: int, start: int = 0) -> list[list[int]]:
    """The global batch of each step: the DP groups' shares, concatenated in DP order."""
    shares = []
    for rank in range(dp):
        sampler = sampler_for_dp(dp, rank)
        sampler.set_step(start)
        shares.append(list(sampler)[:steps])
    return [sum((shares[r][k] for r in range(dp)), []) for k in range(steps)]


def test_global_batches_do_not_depend_on_the_layout() -> None:
    from dspzoo.core.data import SPBatchSampler

    def make(dp: int, rank: int) -> SPBatchSampler:
        return SPBatchSampler(50, 12 // dp, dp, rank, seed=5)  # 12 samples per step, 4 steps

    reference = _global_batches(make, 1, 4)
    assert sorted(sum(reference, [])) != list(range(48))  # shuffled
    for dp in (2, 3, 4):
        assert _global_batches(make, dp, 4) == reference
    # resuming at step 3 (epoch 0) and step 6 (epoch 1) continues the same sequence at any layout
    assert _global_batches(make, 3, 1, start=3) == reference[3:]
    later = _global_batches(make, 1, 2, start=4)
    assert _global_batches(make, 2, 2, start=4) == later
    assert later != reference[:2]  # a new epoch reshuffles


def test_too_small_dataset_is_a_clear_error() -> None:
    import pytest

    from dspzoo.core.data import SPBatchSampler

    with pytest.raises(ValueError, match="too small for one global batch of 8"):
        SPBatchSampler(7, 4, 2, 0)

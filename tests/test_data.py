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

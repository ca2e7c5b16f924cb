"""Durable checkpoints: a complete checkpoint exists at every instant, old ones are pruned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspzoo.core.train import checkpoint as ckpt_mod
from dspzoo.core.train.checkpoint import latest_checkpoint, read_progress, save_checkpoint


class FakeAccelerator:
    """What save_checkpoint uses of an Accelerator, on one process."""

    is_main_process = True

    def __init__(self, payload: str) -> None:
        self.payload = payload

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.bin").write_text(self.payload)


def test_resaving_a_step_never_leaves_it_missing(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(FakeAccelerator("old"), tmp_path, 5, {"note": "first"})
    real_replace = os.replace
    calls = []

    def die_after_moving_the_old_one_aside(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)
        if Path(dst).name.startswith(".old_"):
            raise OSError("power cut")

    monkeypatch.setattr(ckpt_mod.os, "replace", die_after_moving_the_old_one_aside)
    with pytest.raises(OSError, match="power cut"):
        save_checkpoint(FakeAccelerator("new"), tmp_path, 5, {"note": "second"})
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    assert not (tmp_path / "step_5").exists()  # the crash window the old code left open ...
    found = latest_checkpoint(tmp_path)  # ... is closed: the old checkpoint is put back
    assert found == tmp_path / "step_5"
    assert (found / "model.bin").read_text() == "old"
    assert read_progress(found)["note"] == "first"
    # a save that completes replaces it
    save_checkpoint(FakeAccelerator("new"), tmp_path, 5, {"note": "second"})
    assert (tmp_path / "step_5" / "model.bin").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]


def test_incomplete_checkpoints_are_ignored_and_old_ones_pruned(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(FakeAccelerator(str(step)), tmp_path, step, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    (tmp_path / "step_9").mkdir()  # a folder without progress.json is not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "step_4"
    assert json.loads((tmp_path / "step_4" / "progress.json").read_text())["step"] == 4
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        read_progress(tmp_path / "step_9")

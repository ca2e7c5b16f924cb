"""Zoo registry and pretrained folders."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import dspzoo.domains.toy  # noqa: F401  (registers toy2d)
from dspzoo.zoo import (
    CheckpointMismatchError,
    count_parameters,
    create_model,
    format_count,
    from_pretrained,
    get_config,
    list_models,
    load_weights,
    register_config,
    register_family,
    save_pretrained,
    unregister_family,
)
from dspzoo.zoo.cli import main as cli_main
from dspzoo.zoo.registry import resolve_name


@dataclass(frozen=True)
class MLPConfig:
    width: int = 8
    dims: tuple[int, ...] = (3, 4)


class TinyMLP(nn.Module):
    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.net = nn.Sequential(
            nn.Linear(config.dims[0], config.width), nn.Linear(config.width, config.dims[1])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture
def mlp_family():
    register_family("testmlp", TinyMLP, MLPConfig)
    register_config("testmlp", "a", MLPConfig())
    register_config("testmlp", "b", MLPConfig(width=16))
    yield "testmlp"
    unregister_family("testmlp")


def test_create_list_and_override(mlp_family: str) -> None:
    assert {"testmlp-a", "testmlp-b"} <= set(list_models())
    model = create_model("testmlp-a", width=5)
    assert model.config.width == 5 and model.config.dims == (3, 4)
    with pytest.raises(ValueError, match="unknown config field"):
        create_model("testmlp-a", depth=3)
    with pytest.raises(KeyError, match="did you mean"):
        create_model("testmlp-c")
    with pytest.raises(KeyError, match="unknown model family"):
        create_model("nosuch-a")
    with pytest.raises(ValueError, match="already registered"):
        register_config("testmlp", "a", MLPConfig())


def test_meta_device_counts_without_memory(mlp_family: str) -> None:
    model = create_model("testmlp-b", device="meta")
    assert next(model.parameters()).is_meta
    assert count_parameters(model) == 3 * 16 + 16 + 16 * 4 + 4


def test_round_trip_and_atomic_overwrite(mlp_family: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = create_model("testmlp-a")
    path = save_pretrained(model, tmp_path / "ckpt", config_name="a")
    loaded = from_pretrained(path)
    assert loaded.config == model.config  # tuples round-trip
    x = torch.randn(2, 3)
    torch.testing.assert_close(loaded(x), model(x))
    # overwrite in place: the folder stays loadable and holds the new weights, no temp left over
    with torch.no_grad():
        model.net[0].weight.add_(1)
    save_pretrained(model, path)
    torch.testing.assert_close(from_pretrained(path)(x), model(x))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_mismatched_checkpoints_raise(mlp_family: str, tmp_path) -> None:
    save_pretrained(create_model("testmlp-b"), tmp_path / "b")
    with pytest.raises(
        CheckpointMismatchError, match=r"net.0.weight: checkpoint \(16, 3\) vs model \(8, 3\)"
    ):
        load_weights(create_model("testmlp-a"), tmp_path / "b")
    save_pretrained(create_model("toy2d-tiny"), tmp_path / "toy")
    with pytest.raises(CheckpointMismatchError, match="family 'toy2d'"):
        load_weights(create_model("testmlp-a"), tmp_path / "toy")
    with pytest.raises(CheckpointMismatchError, match="expected"):
        from_pretrained(tmp_path / "toy", expected_family="testmlp")


def test_corrupt_files_are_named(mlp_family: str, tmp_path) -> None:
    path = save_pretrained(create_model("testmlp-a"), tmp_path / "ckpt")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(ValueError, match="model.safetensors is corrupt"):
        from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is corrupt"):
        from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "missing")


def test_cli_lists_models(mlp_family: str, capsys) -> None:
    """Every registered model (the test family included) on one line with its count."""
    assert cli_main(["list"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    rows = [line.split() for line in captured.out.splitlines()]
    assert all(len(row) == 2 for row in rows), rows
    listed = dict(rows)
    assert sorted(listed) == list_models() and len(rows) == len(listed)
    assert {"toy2d-tiny", "testmlp-a", "testmlp-b", "stdit-small", "latte-mini"} <= set(listed)
    for name, count in listed.items():
        assert count == format_count(count_parameters(create_model(name, device="meta"))), name
    assert listed["testmlp-b"] == str(3 * 16 + 16 + 16 * 4 + 4)
    assert cli_main(["info", "toy2d-tiny"]) == 0
    assert "  hidden" in capsys.readouterr().out
    assert get_config("toy2d-tiny").hidden == 32
    json.dumps(list_models())


def test_names_ignore_case(mlp_family: str) -> None:
    assert get_config("TestMLP-B").width == 16
    assert create_model("TESTMLP-a").config.width == 8
    assert resolve_name("testmlp-B") == "testmlp-b"
    with pytest.raises(ValueError, match=r"already registered \(as testmlp-a; names ignore case\)"):
        register_config("testmlp", "A", MLPConfig())
    with pytest.raises(ValueError, match="already registered"):
        register_family("TestMLP", TinyMLP, MLPConfig)
    with pytest.raises(KeyError, match=r"did you mean 'testmlp-a'"):
        get_config("testmlp-aa")


@pytest.fixture
def umask():
    """Set a known umask for the test, restore the old one after."""
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    ("mask", "dir_mode", "file_mode"),
    [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)],
)
def test_saved_folder_respects_umask(
    mlp_family: str, tmp_path, umask, mask: int, dir_mode: int, file_mode: int
) -> None:
    umask(mask)
    model = create_model("testmlp-a")
    for _ in range(2):  # a fresh save and an overwrite
        path = save_pretrained(model, tmp_path / "ckpt")
        assert stat.S_IMODE(path.stat().st_mode) == dir_mode
        for name in ("config.json", "model.safetensors"):
            assert stat.S_IMODE((path / name).stat().st_mode) == file_mode, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_save_fsyncs_files_and_folder_before_the_rename(mlp_family: str, tmp_path) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    model = create_model("testmlp-a")
    for overwrite in (False, True):
        events.clear()
        with mock.patch("os.fsync", fsync), mock.patch("os.replace", replace):
            save_pretrained(model, tmp_path / "ckpt")
        into_place = [
            i
            for i, (kind, what) in enumerate(events)
            if kind == "replace" and what.endswith(f"-> {tmp_path / 'ckpt'}")
        ]
        assert len(into_place) == 1, events
        before = [Path(what) for kind, what in events[: into_place[0]] if kind == "fsync"]
        assert {p.name for p in before} >= {"config.json", "model.safetensors"}, events
        tmp_dir = before[0].parent
        assert tmp_dir in before, events  # the folder itself (its entries) is synced
        assert tmp_dir.parent == tmp_path and tmp_dir.name.startswith(".ckpt.tmp-")
        after = [Path(what) for kind, what in events[into_place[0] :] if kind == "fsync"]
        assert tmp_path in after, events  # the rename itself is made durable
        if overwrite:
            assert any(kind == "replace" and ".ckpt.old-" in what for kind, what in events)


def test_crash_between_renames_names_the_previous_checkpoint(mlp_family: str, tmp_path) -> None:
    """A save that dies after moving the old folder aside leaves it findable, and says where."""
    model = create_model("testmlp-a")
    path = save_pretrained(model, tmp_path / "ckpt")
    real_replace = os.replace

    def replace(src, dst) -> None:
        if Path(src).name.startswith(".ckpt.tmp-"):
            raise KeyboardInterrupt  # dies between the two renames
        real_replace(src, dst)

    with mock.patch("os.replace", replace), pytest.raises(KeyboardInterrupt):
        save_pretrained(model, path)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.old-")]
    with pytest.raises(FileNotFoundError, match=rf"interrupted.*{aside.name}"):
        from_pretrained(path)
    os.replace(aside, path)  # what the message tells the user to do
    torch.testing.assert_close(from_pretrained(path).net[0].weight, model.net[0].weight)

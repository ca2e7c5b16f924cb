"""Video data: built-in moving shapes, a folder of real videos, writers."""

from __future__ import annotations

import pytest
import torch

from dspzoo.domains.video.codec import PixelUnshuffleCodec
from dspzoo.domains.video.data import (
    MovingShapesConfig,
    MovingShapesDataset,
    VideoDecodeError,
    VideoFolderDataset,
    read_frames,
)
from dspzoo.domains.video.io import save_frame_strip_png, video_grid, write_video


def test_moving_shapes_are_deterministic_and_in_range() -> None:
    ds = MovingShapesDataset(
        MovingShapesConfig(num_samples=16, frames=5, height=24, width=20, seed=3)
    )
    a, b, c = ds[4], ds[4], ds[5]
    assert torch.equal(a["video"], b["video"]) and not torch.equal(a["video"], c["video"])
    assert a["video"].shape == (3, 5, 24, 20)
    assert a["video"].min() >= -1 and a["video"].max() <= 1
    assert all(0 <= ds[i]["label"] < ds.num_classes for i in range(16))
    assert not torch.equal(a["video"][:, 0], a["video"][:, -1])  # it moves
    with pytest.raises(IndexError):
        ds[16]


def test_video_folder_reads_mp4_and_gif(tmp_path) -> None:
    shapes = MovingShapesDataset(MovingShapesConfig(num_samples=4, frames=12, height=32, width=40))
    write_video(shapes[0]["video"], tmp_path / "cats" / "a.mp4")
    write_video(shapes[1]["video"], tmp_path / "dogs" / "b.gif")
    assert len(read_frames(tmp_path / "dogs" / "b.gif", 100)) == 12
    ds = VideoFolderDataset(tmp_path, frames=4, height=16, width=16, frame_stride=3)
    assert len(ds) == 2 and ds.classes == ["cats", "dogs"]
    sample = ds[1]
    assert sample["video"].shape == (3, 4, 16, 16) and sample["label"] == 1
    long = VideoFolderDataset(tmp_path, frames=20, height=16, width=16)  # longer than the clip
    assert long[1]["video"].shape[1] == 20
    assert torch.equal(long[1]["video"][:, -1], long[1]["video"][:, -2])  # last frame repeated


def test_corrupt_video_raise_or_skip(tmp_path) -> None:
    shapes = MovingShapesDataset(MovingShapesConfig(num_samples=2, frames=4))
    write_video(shapes[0]["video"], tmp_path / "good.gif")
    (tmp_path / "bad.mp4").write_bytes(b"\x00not a video" * 50)
    strict = VideoFolderDataset(tmp_path, frames=4, height=16, width=16)
    with pytest.raises(VideoDecodeError, match="bad.mp4") as caught:
        strict[0]  # sorted: bad.mp4 first
    assert "--on-bad-video skip" in str(caught.value)  # the message says how to go on
    lenient = VideoFolderDataset(tmp_path, frames=4, height=16, width=16, on_error="skip")
    with pytest.warns(UserWarning, match="bad.mp4"):
        sample = lenient[0]
    assert sample["video"].shape == (3, 4, 16, 16)
    assert [p.name for p in lenient.bad_files] == ["bad.mp4"]


def test_empty_folder_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no videos"):
        VideoFolderDataset(tmp_path)


def test_codec_round_trip_and_writers(tmp_path) -> None:
    codec = PixelUnshuffleCodec(2)
    video = torch.rand(2, 3, 4, 8, 12) * 2 - 1
    latents = codec.encode(video)
    assert latents.shape == (2, 12, 4, 4, 6)
    assert torch.equal(codec.decode(latents), video)
    with pytest.raises(ValueError, match="not divisible"):
        codec.encode(torch.rand(1, 3, 2, 7, 8))
    grid = video_grid(video, nrow=2)
    assert grid.shape == (3, 4, 8 + 2, 2 * 12 + 3)
    assert save_frame_strip_png(grid, tmp_path / "strip.png", upscale=2).stat().st_size > 0
    assert write_video(video[0], tmp_path / "clip.mp4").stat().st_size > 0
    with pytest.raises(ValueError, match="unsupported"):
        write_video(video[0], tmp_path / "clip.avi")

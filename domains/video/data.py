"""Video data: the built-in moving-shapes clips and a folder of real videos.

Both return ``{"video": FloatTensor [3, T, H, W] in [-1, 1], "label": LongTensor []}``, and a
sample is a pure function of its index (and seed), so every rank of an SP group that is handed
the same index builds the same clip.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ...core.errors import MissingFileError, UsageError

logger = logging.getLogger(__name__)

SHAPES = ("square", "circle", "triangle", "cross")
PALETTE = np.array(
    [
        [1.0, 0.25, 0.2],
        [0.2, 0.85, 0.3],
        [0.25, 0.45, 1.0],
        [1.0, 0.85, 0.15],
        [0.9, 0.3, 0.95],
        [0.2, 0.9, 0.95],
    ],
    dtype=np.float32,
)
VIDEO_EXTENSIONS = (".mp4", ".webm", ".gif", ".avi", ".mov", ".mkv")


@dataclass(frozen=True)
class MovingShapesConfig:
    """Procedural clips: one coloured shape gliding and bouncing over a dark background."""

    num_samples: int = 1024
    frames: int = 8
    height: int = 32
    width: int = 32
    seed: int = 0
    background: float = -0.8


def _shape_mask(
    kind: str, yy: np.ndarray, xx: np.ndarray, cy: np.ndarray, cx: np.ndarray, r: float
) -> np.ndarray:
    """Boolean ``[T, H, W]`` mask of ``kind`` centred at ``(cy[t], cx[t])`` with half-size ``r``."""
    dy, dx = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None]
    if kind == "square":
        return (np.abs(dy) <= r) & (np.abs(dx) <= r)
    if kind == "circle":
        return dy**2 + dx**2 <= r**2
    if kind == "triangle":  # apex up: width grows linearly from the top to the base
        return (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) / 2)
    arm = max(r / 3, 1.0)
    return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))


class MovingShapesDataset(Dataset):
    """Built-in training data; the label is the shape kind (``num_classes = 4``)."""

    num_classes = len(SHAPES)

    def __init__(self, config: MovingShapesConfig = MovingShapesConfig()) -> None:
        if config.height < 8 or config.width < 8 or config.frames < 1:
            raise UsageError(
                f"moving shapes need frames >= 1 and frames of at least 8×8, got {config}"
            )
        self.config = config
        self._yy, self._xx = np.mgrid[0 : config.height, 0 : config.width].astype(np.float32)

    def __len__(self) -> int:
        return self.config.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        c = self.config
        rng = np.random.default_rng([c.seed, index])
        label = int(rng.integers(len(SHAPES)))
        colour = PALETTE[rng.integers(len(PALETTE))]
        r = float(rng.uniform(min(c.height, c.width) / 8, min(c.height, c.width) / 4.5))
        pos = rng.uniform([r, r], [c.height - 1 - r, c.width - 1 - r])
        vel = rng.uniform(1.0, 2.5, size=2) * rng.choice([-1.0, 1.0], size=2)
        ys, xs = (
            self._trajectory(pos[0], vel[0], r, c.height, c.frames),
            self._trajectory(pos[1], vel[1], r, c.width, c.frames),
        )
        mask = _shape_mask(SHAPES[label], self._yy, self._xx, ys, xs, r)
        video = np.full((3, c.frames, c.height, c.width), c.background, dtype=np.float32)
        for ch in range(3):
            video[ch][mask] = colour[ch] * 2 - 1
        return {"video": torch.from_numpy(video), "label": torch.tensor(label)}

    @staticmethod
    def _trajectory(start: float, speed: float, r: float, size: int, frames: int) -> np.ndarray:
        """Positions over ``frames`` steps bouncing between ``r`` and ``size − 1 − r``."""
        lo, hi = r, size - 1 - r
        span = hi - lo
        raw = start - lo + speed * np.arange(frames)
        folded = np.mod(raw, 2 * span)
        return (lo + np.where(folded > span, 2 * span - folded, folded)).astype(np.float32)


class VideoDecodeError(UsageError):
    """A video file could not be decoded."""


class VideoFolderDataset(Dataset):
    """Videos under a folder (recursively); class = name of the file's first sub-folder.

    Each sample is ``frames`` frames taken every ``frame_stride`` frames from the start of the
    clip (clips that are too short repeat their last frame), resized so the short side fits
    and centre-cropped to ``height × width``.

    Args:
        on_error: ``"raise"`` raises :class:`VideoDecodeError` naming the file and the
            ``--on-bad-video skip`` flag;
            ``"skip"`` warns, records the file in ``bad_files`` and serves the next good one.
    """

    def __init__(
        self,
        root: str | Path,
        frames: int = 8,
        height: int = 32,
        width: int = 32,
        frame_stride: int = 1,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise MissingFileError(f"video folder {self.root} does not exist")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.files = sorted(
            p for p in self.root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file()
        )
        if not self.files:
            raise MissingFileError(
                f"no videos in {self.root} (looked for {', '.join(VIDEO_EXTENSIONS)})"
            )
        self.classes = sorted({self._class_name(p) for p in self.files})
        self.num_classes = len(self.classes)
        self.frames, self.height, self.width, self.frame_stride = (
            frames,
            height,
            width,
            frame_stride,
        )
        self.on_error = on_error
        self.bad_files: set[Path] = set()

    def _class_name(self, path: Path) -> str:
        rel = path.relative_to(self.root)
        return rel.parts[0] if len(rel.parts) > 1 else ""

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        for attempt in range(len(self.files)):
            path = self.files[(index + attempt) % len(self.files)]
            if path in self.bad_files:
                continue
            try:
                video = self._load(path)
            except VideoDecodeError as exc:
                if self.on_error == "raise":
                    raise VideoDecodeError(
                        f"{exc}; to train on the other videos, skipping undecodable ones with "
                        f"a warning, pass --on-bad-video skip (on_error='skip' in Python)"
                    ) from exc
                self.bad_files.add(path)
                warnings.warn(
                    f"skipping undecodable video {path}: {exc.__cause__ or exc}", stacklevel=2
                )
                continue
            return {
                "video": video,
                "label": torch.tensor(self.classes.index(self._class_name(path))),
            }
        raise VideoDecodeError(
            f"none of the {len(self.files)} videos in {self.root} could be decoded"
        )

    def _load(self, path: Path) -> torch.Tensor:
        needed = (self.frames - 1) * self.frame_stride + 1
        frames = read_frames(path, needed)
        picked = frames[:: self.frame_stride][: self.frames]
        while len(picked) < self.frames:
            picked.append(picked[-1])
        clip = (
            torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2).float() / 127.5 - 1
        )  # [T, 3, H, W]
        clip = resize_and_crop(clip, self.height, self.width)
        return clip.permute(1, 0, 2, 3).contiguous()  # [3, T, H, W]


def read_frames(path: Path, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` RGB frames ``[H, W, 3]`` uint8 from the start of a video (PyAV)."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoDecodeError(f"{path} has no video stream")
            frames = []
            for frame in container.decode(video=0):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) >= limit:
                    break
    except VideoDecodeError:
        raise
    except Exception as exc:  # PyAV raises many error types for broken files
        raise VideoDecodeError(f"cannot decode {path}: {exc}") from exc
    if not frames:
        raise VideoDecodeError(f"{path} contains no frames")
    return frames


def resize_and_crop(clip: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[T, C, H, W]`` → short side scaled to cover ``height × width``, centre-cropped."""
    _, _, h, w = clip.shape
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    clip = F.interpolate(
        clip, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False
    )
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return clip[:, :, top : top + height, left : left + width].clamp(-1, 1)

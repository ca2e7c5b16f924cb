"""Writing clips to GIF / MP4 / PNG for inspection and docs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from einops import rearrange

from ...core.errors import UsageError


def to_uint8_frames(video: torch.Tensor, upscale: int = 1) -> np.ndarray:
    """``[C, T, H, W]`` in [-1, 1] → ``[T, H·upscale, W·upscale, 3]`` uint8 (nearest upscaling)."""
    if video.dim() != 4 or video.shape[0] not in (1, 3):
        raise ValueError(f"expected a clip [C=1|3, T, H, W], got {tuple(video.shape)}")
    frames = ((video.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if frames.shape[0] == 1:
        frames = frames.expand(3, -1, -1, -1)
    if upscale > 1:
        frames = frames.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    return rearrange(frames, "c t h w -> t h w c").numpy()


def video_grid(videos: torch.Tensor, nrow: int, pad: int = 1, value: float = 1.0) -> torch.Tensor:
    """Tile ``[N, C, T, H, W]`` clips into one ``[C, T, H', W']`` clip, ``nrow`` per row."""
    n, c, t, h, w = videos.shape
    rows = (n + nrow - 1) // nrow
    grid = torch.full(
        (c, t, rows * (h + pad) + pad, nrow * (w + pad) + pad), value, dtype=videos.dtype
    )
    for i in range(n):
        r, k = divmod(i, nrow)
        top, left = pad + r * (h + pad), pad + k * (w + pad)
        grid[:, :, top : top + h, left : left + w] = videos[i]
    return grid


def write_video(video: torch.Tensor, path: str | Path, fps: int = 8, upscale: int = 1) -> Path:
    """Write ``[C, T, H, W]`` in [-1, 1] as ``.gif`` (Pillow) or ``.mp4`` (PyAV) by suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(video, upscale)
    suffix = path.suffix.lower()
    if suffix == ".gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        images[0].save(
            path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0
        )
    elif suffix == ".mp4":
        _write_mp4(frames, path, fps)
    else:
        raise UsageError(f"unsupported video suffix {suffix!r}; use .gif or .mp4")
    return path


def _write_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    import av

    t, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p needs even sizes
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with av.open(str(path), mode="w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def save_frame_strip_png(video: torch.Tensor, path: str | Path, upscale: int = 1) -> Path:
    """Frames of ``[C, T, H, W]`` side by side in one PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(video, upscale)
    Image.fromarray(np.concatenate(list(frames), axis=1)).save(path)
    return path

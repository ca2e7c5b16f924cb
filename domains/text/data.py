"""Byte windows over one long file (the enwik8 format: raw bytes, no tokenizer).

:class:`ByteWindows` cuts a byte file into windows of ``seq_len + 1`` bytes; item ``i`` is the
window starting at byte ``i · seq_len`` of its split, returned as ``tokens`` (the first
``seq_len`` bytes) and ``targets`` (the last ``seq_len``: the next byte of every position).
Items are pure functions of the index, so a run draws the same data at any dp × sp layout.
The last ``val_fraction`` (5 %) of the file is the validation split, the rest the training
split; windows never cross the boundary.

The built-in corpus (``--data stdlib``) is real, freely licensed text every Python
installation has: the Python standard library's own ``*.py`` sources (PSF License) without its
test suites, sorted by path and concatenated with a one-line header per file, up to 16 MiB
(about 12 MiB from 734 files for CPython 3.11). It is built at first use
and cached (written atomically) under ``$DSPZOO_CACHE`` or ``~/.cache/dspzoo``.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dspzoo.core.durable import fsync_path

from ...core.errors import MissingFileError, UsageError

STDLIB_CAP_BYTES = 16 * 2**20
CORPUS_FORMAT = 1  # bump when the way the corpus is built changes (new cache file)
SPLITS = ("train", "val")
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


class ByteWindows(Dataset):
    """``seq_len + 1``-byte windows of a raw byte file, for next-byte prediction.

    Args:
        path: the byte file (e.g. enwik8).
        seq_len: model input length L.
        split: ``"train"`` (the first 95 %) or ``"val"`` (the last ``val_fraction``).
        val_fraction: share of the file held out for validation, taken from its end.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` when the split is
    shorter than one window.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        split: str = "train",
        val_fraction: float = 0.05,
    ) -> None:
        path = Path(path)
        if not path.is_file():
            raise MissingFileError(f"byte data file {path} does not exist (or is not a file)")
        if split not in SPLITS:
            raise UsageError(f"split must be one of {SPLITS}, got {split!r}")
        if seq_len < 1:
            raise UsageError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise UsageError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if split == "val" and val_fraction == 0.0:
            raise UsageError("val_fraction 0 holds nothing out: there is no val split")
        size = path.stat().st_size
        val_start = size - int(size * val_fraction)
        start, stop = (0, val_start) if split == "train" else (val_start, size)
        if stop - start < seq_len + 1:
            raise UsageError(
                f"{path} has {size} bytes; its {split} split ({stop - start} bytes) is shorter "
                f"than one window of seq_len + 1 = {seq_len + 1} bytes"
            )
        self.path, self.seq_len, self.split = path, seq_len, split
        self.start, self.stop = start, stop
        self._bytes: np.ndarray | None = None  # opened lazily (and once per worker process)

    def __len__(self) -> int:
        # consecutive windows share one byte: the last target of one is the next's first input
        return (self.stop - self.start - 1) // self.seq_len

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` bytes of window ``index`` as uint8."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        if self._bytes is None:
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r")
        first = self.start + index * self.seq_len
        return np.asarray(self._bytes[first : first + self.seq_len + 1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self.window(index).astype(np.int64))
        return {"tokens": window[:-1], "targets": window[1:]}

    def __getstate__(self) -> dict:  # memmaps are reopened in each worker
        return {**self.__dict__, "_bytes": None}


# -- the built-in corpus: the Python standard library's sources --------------------------------


def cache_dir() -> Path:
    """``$DSPZOO_CACHE``, else ``~/.cache/dspzoo``."""
    return Path(os.environ.get("DSPZOO_CACHE") or Path.home() / ".cache" / "dspzoo")


def stdlib_sources() -> tuple[Path, list[Path]]:
    """The standard library folder and its ``*.py`` files, sorted by relative path.

    Third-party packages (``site-packages`` / ``dist-packages``) and the test suites
    (``test``, ``tests``, ``idle_test`` folders) are left out: what remains is the library's
    own code and docstrings.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise MissingFileError(f"the Python standard library folder {root} does not exist")
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not set(p.relative_to(root).parts) & SKIPPED_FOLDERS
    ]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(cap_bytes: int = STDLIB_CAP_BYTES, folder: Path | None = None) -> Path:
    """Path of the cached standard-library corpus, built on first use.

    Whole files are taken in sorted order while they fit in ``cap_bytes``; each is preceded
    by a header line ``# ==> <relative path> <==``. The file is written to a temporary name,
    fsynced and renamed into place (safe when several processes build it at once); a
    ``.json`` manifest next to it lists the Python version, the files and the size.
    """
    folder = cache_dir() if folder is None else Path(folder)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = folder / f"stdlib-v{CORPUS_FORMAT}-py{version}-{cap_bytes}.bytes"
    if path.is_file():
        return path
    root, files = stdlib_sources()
    parts: list[bytes] = []
    used: list[str] = []
    total = 0
    for file in files:
        rel = file.relative_to(root).as_posix()
        piece = f"# ==> {rel} <==\n".encode() + file.read_bytes().rstrip(b"\n") + b"\n\n"
        if total + len(piece) > cap_bytes:
            break
        parts.append(piece)
        used.append(rel)
        total += len(piece)
    if not parts:
        raise UsageError(f"no standard-library source fits in {cap_bytes} bytes under {root}")
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "source": str(root),
        "python": sys.version.split()[0],
        "licence": "PSF License Agreement (the Python standard library)",
        "bytes": total,
        "files": used,
        "files_available": len(files),
    }
    _write_atomically(path.with_suffix(".json"), json.dumps(manifest, indent=1).encode())
    _write_atomically(path, b"".join(parts))
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def resolve_data(data: str) -> Path:
    """``"stdlib"`` → the built-in corpus (built if needed); anything else is a file path."""
    return stdlib_corpus() if data == "stdlib" else Path(data)

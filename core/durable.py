"""Durable file writes: fsync files and directories, write JSON through a rename."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """fsync one file or directory (directories: their entries)."""
    is_dir = path.is_dir()
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if is_dir:  # platforms that cannot open directories (Windows): nothing to sync
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (inclusive), children before parents."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def chmod_files_like(root: Path, reference: Path) -> None:
    """Give every file under ``root`` the permission bits of ``reference`` (a file created
    with the umask-derived mode): writers that go through a private temporary file
    (safetensors' 0600) leave files only their owner can read."""
    mode = reference.stat().st_mode & 0o7777
    for folder, _dirs, files in os.walk(root):
        for name in files:
            os.chmod(Path(folder) / name, mode)


def write_json_durably(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)

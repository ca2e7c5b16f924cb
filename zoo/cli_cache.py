"""What ``dspzoo list`` and ``dspzoo info <name>`` printed, kept for the next run.

Both need every model family, so torch and every domain (seconds), and ``list`` builds each
model on the meta device to count its parameters (seconds more). Their output depends only on
dspzoo's own files, so a command run from the shell (:func:`dspzoo.zoo.cli.main` without
``argv``) stores what it printed under a fingerprint of those files (path, size and
modification time of each, and the version), and the next run with the same fingerprint
prints it without importing torch. Any edit to dspzoo's code or shipped cards changes the
fingerprint, and then the output is computed again.

Nothing is kept or reused while families come from outside dspzoo (a ``dspzoo.families``
entry point or ``DSPZOO_FAMILIES``): their code is not fingerprinted. The cache is the file
``dspzoo/cli-outputs.json`` under ``$DSPZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
``~/.cache``; ``DSPZOO_CACHE_DIR=`` (empty) turns it off. A file that cannot be read or
written is no error: the command computes its output as it would without one.

This module imports nothing of dspzoo (``dspzoo --help`` imports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

ENV_VAR = "DSPZOO_CACHE_DIR"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
#: folders of the package root that hold no code the outputs depend on
NOT_FINGERPRINTED = frozenset({"tests", "docs", "outputs", "__pycache__"})
#: the families from outside dspzoo (as zoo/families.py names them; it imports torch)
FAMILIES_GROUP = "dspzoo.families"
FAMILIES_ENV_VAR = "DSPZOO_FAMILIES"


def cache_file() -> Path | None:
    """Where the outputs are kept, or ``None`` when ``DSPZOO_CACHE_DIR`` is set empty."""
    folder = os.environ.get(ENV_VAR)
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "dspzoo" / "cli-outputs.json"
    return Path(folder) / "dspzoo" / "cli-outputs.json" if folder else None


def fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the version and of every file's path, size and modification time under
    ``root`` (hidden entries and :data:`NOT_FINGERPRINTED` folders left out)."""
    from dspzoo import __version__

    digest = hashlib.sha256(__version__.encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_FINGERPRINTED and not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(folder) / name
            try:
                st = path.stat()
            except OSError:
                continue
            digest.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def outside_families() -> bool:
    """Whether model families may come from outside dspzoo (entry points, the variable)."""
    if os.environ.get(FAMILIES_ENV_VAR, "").strip():
        return True
    from importlib.metadata import entry_points

    return bool(list(entry_points(group=FAMILIES_GROUP)))


def _key(words: list[str]) -> str:
    return "\0".join(words)


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(words: list[str]) -> str | None:
    """What the command ``words`` printed last time with this fingerprint, or ``None``."""
    file = cache_file()
    if file is None or not file.is_file() or outside_families():
        return None
    data = _read(file)
    if data.get("fingerprint") != fingerprint():
        return None
    text = data.get("outputs", {}).get(_key(words))
    return text if isinstance(text, str) else None


def store(words: list[str], text: str) -> None:
    """Keep ``text``, what the command ``words`` printed (quietly nothing where the cache
    cannot be written, or is off)."""
    file = cache_file()
    if file is None or outside_families():
        return
    stamp = fingerprint()
    data = _read(file)
    if data.get("fingerprint") != stamp or not isinstance(data.get("outputs"), dict):
        data = {"fingerprint": stamp, "outputs": {}}
    data["outputs"][_key(words)] = text
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, file)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()

"""Durable training checkpoints: written aside, fsynced, swapped into place, pruned.

A checkpoint is ``<dir>/step_N``: Accelerate's ``save_state`` (model, optimizer, registered
objects such as the LR schedule and the EMA) plus ``progress.json`` (step, layout, loss
history, …), which is written last and marks the checkpoint complete. Saving

1. writes everything into ``.tmp_step_N`` and fsyncs every file and directory in it,
2. moves an existing ``step_N`` aside to ``.old_step_N``, renames the new folder into place and
   fsyncs the parent, then deletes the old one,
3. keeps the newest ``keep`` complete checkpoints.

At every instant a complete checkpoint exists on disk: if the process dies between the two
renames of step 2, :func:`recover_interrupted_save` restores ``.old_step_N``. Recovery renames
folders, so in a multi-process run one process does it and the others wait at a barrier
(:func:`dspzoo.core.train.resume.find_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..durable import chmod_files_like, fsync_path, fsync_tree, write_json_durably
from ..errors import MissingFileError

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"


def _step_of(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1])


def recover_interrupted_save(ckpt_dir: Path) -> None:
    """Put back a checkpoint moved aside by a save that died between its two renames.

    Renames and deletes folders: call it on one process only (then a barrier).
    """
    for old in ckpt_dir.glob(".old_step_*"):
        final = ckpt_dir / old.name.removeprefix(".old_")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            logger.warning("restoring %s, left aside by an interrupted save", final)
            os.replace(old, final)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete ``step_N`` folders under ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and (p / PROGRESS_FILE).is_file()]
    return sorted(found, key=_step_of)


def latest_checkpoint(ckpt_dir: Path, recover: bool = True) -> Path | None:
    """The newest complete checkpoint, or ``None``; with ``recover`` first put back a
    checkpoint an interrupted save left aside (one process only: it renames folders)."""
    if recover and ckpt_dir.is_dir():
        recover_interrupted_save(ckpt_dir)
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def read_progress(ckpt: Path) -> dict[str, Any]:
    """The ``progress.json`` of checkpoint ``ckpt``, with a clear error if it is missing."""
    path = ckpt / PROGRESS_FILE
    if not path.is_file():
        raise MissingFileError(
            f"{ckpt} is not a complete checkpoint (no {PROGRESS_FILE}); pick another with --resume"
        )
    return json.loads(path.read_text())


def save_checkpoint(
    accelerator: Any,
    ckpt_dir: Path,
    step: int,
    progress: dict[str, Any],
    keep: int | None = 3,
) -> Path:
    """Save Accelerate's state and ``progress`` as ``ckpt_dir/step_<step>``, durably.

    Call on every rank (``save_state`` is collective). ``keep``: how many complete
    checkpoints to keep (``None`` or 0: all). Returns the checkpoint path.
    """
    final = ckpt_dir / f"step_{step}"
    tmp = ckpt_dir / f".tmp_step_{step}"
    is_main = accelerator.is_main_process
    if is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # debris of a save that died
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    with quiet_accelerate_state():  # its lines name the temporary folder, one per file
        accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if is_main:
        write_json_durably(tmp / PROGRESS_FILE, {**progress, "step": step})
        # model.safetensors comes 0600 (written through a private temporary file): every
        # file gets the umask-derived mode progress.json was created with
        chmod_files_like(tmp, tmp / PROGRESS_FILE)
        fsync_tree(tmp)
        old = ckpt_dir / f".old_step_{step}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)
        if keep:
            for stale in complete_checkpoints(ckpt_dir)[:-keep]:
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("checkpoint of step %d saved: %s", step, final)
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def quiet_accelerate_state() -> Iterator[None]:
    """Accelerate's ``save_state`` logs a line per file it writes (at INFO, naming the
    temporary folder this module renames), and ``load_state`` one per kind of state ("All
    model weights loaded successfully", ...); hold its loggers at WARNING meanwhile, so that a
    checkpoint or a resume is one line (:func:`save_checkpoint`'s, ``resumed from ...``) and
    their warnings still show."""
    loggers = [logging.getLogger(f"accelerate.{name}") for name in ("checkpointing", "accelerator")]
    levels = [log.level for log in loggers]
    for log, level in zip(loggers, levels):
        log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)

"""Resuming a training run at any dp × sp layout, and the step-time figure every loop logs.

A run whose randomness is keyed by (seed, step, sample) (:mod:`dspzoo.core.parallel.rng`) and whose
data order comes from (seed, epoch) (:class:`dspzoo.core.data.SPBatchSampler`) continues
exactly after a resume at another layout or under another strategy; :func:`resume_from`
loads the checkpoint, re-seeds the global RNGs identically inside every SP group, and says in
the log what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ExistingFileError, MissingFileError
from ..parallel.mesh import SPMesh, seed_everything
from ..parallel.rng import mix_key
from .checkpoint import (
    complete_checkpoints,
    latest_checkpoint,
    quiet_accelerate_state,
    read_progress,
    recover_interrupted_save,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("dspzoo.resume")


def layout_of(mesh: SPMesh) -> dict[str, int]:
    """The dp × sp layout recorded in checkpoints: ``{"world", "dp", "sp"}``."""
    return {"world": mesh.world_size, "dp": mesh.dp_size, "sp": mesh.sp_size}


def find_checkpoint(
    resume: str,
    ckpt_dir: Path,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """``--resume``'s checkpoint: ``"latest"`` in ``ckpt_dir``, or a folder; clear errors.

    For ``"latest"`` the main process first puts back a checkpoint an interrupted save left
    aside (renames: one process only); every process then waits at ``barrier`` and looks the
    newest one up, so all of them find the same folder (or all raise).
    """
    ckpt: Path | None = Path(resume)
    if resume == "latest":
        if is_main and ckpt_dir.is_dir():
            recover_interrupted_save(ckpt_dir)
        if barrier is not None:
            barrier()
        ckpt = latest_checkpoint(ckpt_dir, recover=False)
    if ckpt is None or not ckpt.exists():
        raise MissingFileError(
            f"--resume latest: no checkpoint in {ckpt_dir}"
            if resume == "latest"
            else f"--resume {resume}: no checkpoint folder {Path(resume).resolve()} (give an "
            f"existing step_N folder, or --resume latest for the newest in {ckpt_dir})"
        )
    return ckpt


def refuse_stale_checkpoints(mesh: SPMesh, ckpt_dir: Path, device: torch.device | str) -> None:
    """A fresh run (no ``--resume``) into an output folder that already holds an earlier run's
    checkpoints raises ``FileExistsError`` on every rank: its checkpoints would sit beside the
    old ones and ``--resume latest`` could pick an old run's step (collective).

    ``device``: where the count is all-reduced — the run's device (a GPU under NCCL, which has
    no CPU collectives)."""
    import torch
    import torch.distributed as dist

    found = complete_checkpoints(ckpt_dir)
    stale = torch.tensor([len(found)], dtype=torch.int64, device=device)
    if mesh.world_size > 1:
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=mesh.grad_group)
    if int(stale):
        names = ", ".join(p.name for p in found[-3:]) or f"{int(stale)} on another machine"
        raise ExistingFileError(
            f"{ckpt_dir} already holds checkpoints of an earlier run ({names}): pass --resume "
            f"latest to continue it, or give another --output-dir (or delete the old one)"
        )


def resume_from(
    accelerator: Any,
    mesh: SPMesh,
    resume: str,
    ckpt_dir: Path,
    seed: int,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Load ``resume``'s checkpoint into ``accelerator``'s objects; return its progress record.

    ``settings``: this run's values of what changes the loss sequence (global batch, seed,
    sequence length…); a checkpoint saved with others gets a warning naming them. Accelerate
    restores per-process RNG states (missing ones when the world grew), so the global RNGs are
    re-seeded from ``(seed, step)`` afterwards: identical inside every SP group again.
    """
    ckpt = find_checkpoint(resume, ckpt_dir, mesh.is_main, accelerator.wait_for_everyone)
    progress = read_progress(ckpt)
    with quiet_accelerate_state():  # no "All ... loaded successfully" line per kind of state
        accelerator.load_state(str(ckpt))
    step = int(progress["step"])
    seed_everything(mesh, mix_key(seed, step, "global-rng"))
    if mesh.is_main:
        logger.info("resumed from %s at step %d", ckpt, step)
        saved, now = progress.get("layout"), layout_of(mesh)
        if saved is not None and saved != now:
            logger.warning(
                "resuming a checkpoint saved at dp %d × sp %d (%d processes) at dp %d × sp %d "
                "(%d processes): data order and training randomness are keyed by (seed, step, "
                "sample), so the run continues as it would have at the old layout",
                saved["dp"], saved["sp"], saved["world"], now["dp"], now["sp"], now["world"],
            )  # fmt: skip
        for key, value in settings.items():
            if progress.get(key, value) != value:
                logger.warning(
                    "the checkpoint was trained with --%s %s, this run uses %s: the loss "
                    "sequence will differ from an uninterrupted run",
                    key.replace("_", "-"),
                    progress.get(key),
                    value,
                )
    return progress


def mean_step_time(timings: list[float], last: int | None = None) -> float:
    """Mean of the ``last`` step times, leaving out the session's first (warm-up) step when
    there are others."""
    rest = timings[1:] if len(timings) > 1 else timings
    rest = rest[-last:] if last else rest
    return sum(rest) / len(rest) if rest else float("nan")

"""The Trainer's own rules: the last step is checkpointed, a finished run extended with more
``--steps`` resumes from it, interrupted saves are recovered on one rank, and gradients are
synchronised by the strategy's policy on the mesh's gradient communicator."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.testing import run_distributed
from dspzoo.examples.axial3d_training import Axial3DTrainConfig, train


def _config(out: Path, **kw) -> Axial3DTrainConfig:
    base = dict(model="axial3d-tiny", sp=1, frames=5, size=12, steps=4, global_batch=2,
                warmup=2, log_every=1, save_every=2, eval_clips=2, output_dir=str(out))  # fmt: skip
    return Axial3DTrainConfig(**{**base, **kw})


def test_the_last_step_is_checkpointed_and_more_steps_resume_from_it(tmp_path: Path) -> None:
    first = train(_config(tmp_path, steps=3))  # save_every 2: step 2, and the last step, 3
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]
    progress = json.loads((ckpts / "step_3" / "progress.json").read_text())
    assert progress["step"] == 3 and progress["loss_history"] == first["losses"]
    assert progress["evals"][-1][0] == 3  # the final evaluation is in the last checkpoint
    more = train(_config(tmp_path, steps=5, resume="latest"))
    assert len(more["losses"]) == 2  # steps 4 and 5 only: nothing is redone
    assert more["loss_history"][:3] == first["losses"]
    assert (ckpts / "step_5").is_dir()
    assert json.loads((tmp_path / "losses.json").read_text())["mse"] == more["loss_history"]


def test_without_periodic_saves_the_last_step_is_still_checkpointed(tmp_path: Path) -> None:
    train(_config(tmp_path, steps=2, save_every=0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    # a fresh run into the same folder would put its checkpoints beside the old run's, where
    # --resume latest could pick the old run's last step: refused, naming the way out
    recorded = (tmp_path / "train_config.json").read_bytes()
    with pytest.raises(FileExistsError, match=r"step_2\): pass --resume latest to continue it"):
        train(_config(tmp_path, steps=1, save_every=0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    # the refused run wrote nothing: the earlier run's settings are still the recorded ones
    assert (tmp_path / "train_config.json").read_bytes() == recorded
    assert json.loads(recorded)["steps"] == 2


def test_a_session_says_how_far_the_run_is(tmp_path: Path, caplog) -> None:
    """``--stop-after``: "stopped at step 2 of 3"; resumed at or past ``--steps``: a warning
    that there is nothing to train, and no speed figures (no step ran)."""
    caplog.set_level("INFO")
    train(_config(tmp_path, steps=3, save_every=0, stop_after=2))
    assert "done: stopped at step 2 of 3 (--resume latest continues)" in caplog.text
    caplog.clear()
    again = train(_config(tmp_path, steps=2, save_every=0, resume="latest"))
    assert again["losses"] == []
    assert "at step 2, at or past --steps 2: nothing to train in this session" in caplog.text
    assert "done: 2 steps, no step in this session" in caplog.text
    assert "nan" not in caplog.text


def _stale_checkpoints_on_one_rank(rank: int, world: int, folder: str) -> str:
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.train.resume import refuse_stale_checkpoints

    ckpts = Path(folder) / f"rank{rank}"  # as if each machine had its own output folder
    if rank == 1:
        (ckpts / "step_7").mkdir(parents=True)
        (ckpts / "step_7" / "progress.json").write_text("{}")
    try:
        refuse_stale_checkpoints(build_mesh(world, timeout_s=30), ckpts, "cpu")
    except FileExistsError as exc:
        return str(exc)
    return "no error"


def test_stale_checkpoints_on_one_machine_stop_every_rank(tmp_path: Path) -> None:
    errors = run_distributed(_stale_checkpoints_on_one_rank, 2, str(tmp_path), timeout=120)
    assert "(step_7)" in errors[1] and "(1 on another machine)" in errors[0]


def _unwritable_output_folder(rank: int, world: int, folder: str) -> str:
    from dspzoo.core.parallel.mesh import build_mesh
    from dspzoo.core.train.config import record_run_config

    blocker = Path(folder) / "a-file"  # the output folder would be inside a file
    if rank == 0:
        blocker.write_text("")
    try:
        record_run_config(_config(blocker / "run"), build_mesh(world, timeout_s=30))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_output_folder_the_main_process_cannot_write_stops_every_rank(tmp_path: Path) -> None:
    """Only the main process writes train_config.json; its failure reaches the other ranks
    (which would otherwise go on into the first step's collectives and wait there)."""
    errors = run_distributed(_unwritable_output_folder, 2, str(tmp_path), timeout=120)
    assert all("cannot be written" in e for e in errors), errors


def _find_latest(rank: int, world: int, folder: str) -> tuple[str, list[tuple[str, str]]]:
    from dspzoo.core.train import checkpoint
    from dspzoo.core.train.resume import find_checkpoint

    renames: list[tuple[str, str]] = []
    real = os.replace

    def recording(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        real(src, dst)

    checkpoint.os.replace = recording
    try:
        found = find_checkpoint("latest", Path(folder), is_main=rank == 0, barrier=dist.barrier)
    finally:
        checkpoint.os.replace = real
    return str(found), renames


def test_an_interrupted_save_is_recovered_by_one_rank(tmp_path: Path) -> None:
    """A save died between its two renames (``step_3`` moved aside): at SP 2 rank 0 puts it
    back, rank 1 waits at the barrier and renames nothing; both resume from ``step_3``."""
    for name in ("step_1", ".old_step_3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "progress.json").write_text(json.dumps({"step": int(name[-1])}))
    (rank0, renames0), (rank1, renames1) = run_distributed(_find_latest, 2, str(tmp_path))
    assert rank0 == rank1 == str(tmp_path / "step_3")
    assert renames0 == [(".old_step_3", "step_3")] and renames1 == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]


class _Accelerator:
    """What GradientSync uses of an Accelerator, on CPU."""

    device = torch.device("cpu")
    local_process_index = 0

    def prepare_model(self, model, evaluation_mode=False):
        return model

    def prepare_optimizer(self, optimizer):
        return optimizer


def _prepared_group(rank: int, world: int, own_group: bool) -> dict:
    from dspzoo.core import SeqParallel, build_mesh
    from dspzoo.core.train import GradientSync

    mesh = build_mesh(2)
    if own_group:  # what the mesh provides (a communicator of its own over dp × sp)
        object.__setattr__(mesh, "grad_group", dist.new_group(list(range(world))))  # frozen
    sync = GradientSync(_Accelerator(), mesh, SeqParallel(mesh))
    model = torch.nn.Linear(3, 2)
    ddp, _ = sync.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    expected = getattr(mesh, "grad_group", None) or dist.distributed_c10d._get_default_group()
    tensor_parallel = GradientSync(_Accelerator(), mesh, SeqParallel(mesh, "megatron_sp"))
    return {
        "ddp": isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
        "group": ddp.process_group is expected,
        "methods": (sync.method, tensor_parallel.method),
    }


@pytest.mark.parametrize("own_group", [True, False])
def test_ddp_runs_on_the_gradient_communicator(own_group: bool) -> None:
    """Every strategy but megatron_sp trains under DDP, on ``mesh.grad_group`` when the mesh
    has one (else the default group); megatron_sp takes the tensor-parallel path."""
    for result in run_distributed(_prepared_group, 2, own_group):
        assert result == {"ddp": True, "group": True, "methods": ("ddp", "tensor-parallel")}


def test_a_task_refuses_another_domains_config() -> None:
    from dspzoo.domains.text.training import TextTrainConfig
    from dspzoo.examples.axial3d_training import Axial3DTask

    with pytest.raises(TypeError, match="Axial3DTask takes a Axial3DTrainConfig, got Text"):
        Axial3DTask(TextTrainConfig())

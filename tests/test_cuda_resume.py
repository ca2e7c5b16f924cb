"""A run with an EMA, cut and resumed on one process, is the uninterrupted run — on the CPU and
on CUDA.

The video domain (``stdit-tiny``: the video Task is the one that keeps an EMA) trains ``STEPS``
steps in one session, and again cut after ``CUT`` steps (``--stop-after``) and resumed from that
checkpoint by a fresh Trainer. The resumed session must be the rest of the uninterrupted one:
the same batches (data order), the same keyed draws (noise, timesteps, label dropout: the
losses), the same per-step losses, and the same parameters, EMA averages and Adam moments at the
end. Right after the resume, the restored state is the cut session's last state, bit for bit,
and every tensor of it lives on the run's device (Accelerate loads checkpoints onto the CPU; the
EMA and the optimizer must put their state back next to the parameters). A resume re-seeds the
global RNGs from ``(seed, step)``, not to the state the uninterrupted run had there, so
bit-equal losses also show that no draw of the run comes from them (every one is keyed).

On CUDA the runs use ``torch.use_deterministic_algorithms`` (and the cuBLAS workspace setting it
asks for), so equality stays bitwise there too: two runs execute the same kernels on the same
inputs, and the only kernels that could differ run to run (atomics in the backward of
memory-efficient attention, which SDPA picks for float32 on CUDA) take their deterministic
variant in that mode. A checkpoint written on CUDA is also resumed on the CPU: the restored state
is the checkpoint's exactly, on the CPU, and the run goes on to the last step.

The Accelerator's device is chosen once per process (Accelerate keeps it in a shared state), so
every run here starts from a fresh Accelerate state; ``ACCELERATE_USE_CPU`` (what ``accelerate
launch --cpu`` sets) keeps the CPU case on the CPU on a machine with a GPU.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from cuda_marks import CUDA, DEVICES
from test_video_training import COMMON as VIDEO_RUN

from dspzoo.core.train import Trainer
from dspzoo.domains.video.training import VideoTask, VideoTrainConfig

# deterministic cuBLAS (what torch.use_deterministic_algorithms asks for on CUDA); PyTorch reads
# it once, at the process's first cuBLAS call, so it is set at collection, before any test runs
# (it stays set for the whole pytest session: it only changes cuBLAS's workspace, not results)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

STEPS, CUT = 4, 2
COMMON = dict(
    VIDEO_RUN,  # the video training tests' small stdit-tiny run (their edits reach here too)
    sp=1,
    steps=STEPS,
    save_every=0,
    lr=1e-3,
    ema=0.9,
    class_dropout=0.5,  # label dropout actually drops: its keyed draws are part of the run
)


def _state(trainer: Trainer) -> dict[str, Any]:
    """Everything a resume must restore, copied: parameters, EMA, optimizer, schedule."""
    ema = trainer.ema
    assert ema is not None
    return {
        "params": {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()},
        "ema": {n: s.clone() for n, s in ema.shadow.items()},
        "ema_updates": ema.updates,
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scheduler": trainer.scheduler.state_dict(),
    }


class ObservedTrainer(Trainer):
    """The Trainer, keeping what the test compares: the batches of each step, the state right
    after ``restore`` and at the end of the session (before the final model takes the EMA
    weights)."""

    def __init__(self, task: VideoTask) -> None:
        super().__init__(task)
        self.batches: dict[int, dict[str, torch.Tensor]] = {}
        self.restored: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None

    def restore(self) -> tuple[int, list[float]]:
        progress = super().restore()
        self.restored = _state(self)
        return progress

    def step(self, batch: Any, step: int, meter: Any = None) -> float:
        self.batches[step] = {k: v.clone() for k, v in batch.items()}
        return super().step(batch, step, meter)

    def finish(self, step: int, history: list[float], start_step: int) -> None:
        self.ended = _state(self)
        super().finish(step, history, start_step)


def _train(monkeypatch: pytest.MonkeyPatch, device: str, out: Path, **kw: Any):
    """One session on ``device`` from a fresh Accelerate state; returns (trainer, result)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    if device == "cpu":
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    else:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    cfg = VideoTrainConfig(**{**COMMON, "output_dir": str(out), **kw})
    trainer = ObservedTrainer(VideoTask(cfg))
    result = trainer.run()
    assert trainer.accelerator.device.type == device
    return trainer, result


@pytest.fixture
def fresh_accelerate():
    """Leave Accelerate's per-process state as a later test expects it: not initialised."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def deterministic(request: pytest.FixtureRequest):
    """On CUDA: deterministic kernels, an error naming any op that has none (restored
    afterwards); the CPU kernels of this run are deterministic already."""
    if request.node.callspec.params["device"] != "cuda":
        yield
        return
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _tensors(tree: Any, path: str = "") -> dict[str, Any]:
    """The leaves of nested dicts/lists by path."""
    if isinstance(tree, dict):
        return {
            k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{path}/{key}").items()
        }
    if isinstance(tree, list | tuple):
        return {k: v for i, sub in enumerate(tree) for k, v in _tensors(sub, f"{path}/{i}").items()}
    return {path: tree}


def assert_identical(got: Any, want: Any, what: str) -> None:
    """Same structure, same leaves: tensors bitwise equal (dtype, shape, device, values)."""
    got, want = _tensors(got), _tensors(want)
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())[:5]}"
    for key, value in want.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor), f"{what}{key}"
            assert other.device == value.device, f"{what}{key}: {other.device} != {value.device}"
            assert other.dtype == value.dtype and other.shape == value.shape, f"{what}{key}"
            assert torch.equal(other, value), (
                f"{what}{key}: differs by {(other - value).abs().max()}"
            )
        else:
            assert other == value, f"{what}{key}: {other!r} != {value!r}"


def assert_on(state: dict[str, Any], device: str) -> None:
    """Parameters, EMA averages and Adam moments on ``device`` (Adam's step count, a scalar
    kept on the CPU by the non-fused optimizer, is left out)."""
    for name in ("params", "ema"):
        for key, tensor in state[name].items():
            assert tensor.device.type == device, f"{name} {key} on {tensor.device}"
    moments = [
        (key, t)
        for key, t in _tensors(state["optimizer"]["state"]).items()
        if not key.endswith("/step")
    ]
    assert moments, "no optimizer state"
    for key, tensor in moments:
        assert tensor.device.type == device, f"optimizer state {key} on {tensor.device}"


def _on_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_on_cpu(v) for v in tree)
    return tree


@pytest.mark.parametrize("device", DEVICES)
def test_ema_run_resumed_on_one_process_is_the_uninterrupted_run(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_accelerate, deterministic
) -> None:
    full, full_result = _train(monkeypatch, device, tmp_path / "full")
    cut, cut_result = _train(monkeypatch, device, tmp_path / "cut", stop_after=CUT)
    resumed, resumed_result = _train(monkeypatch, device, tmp_path / "cut", resume="latest")

    # the losses, step by step, bit for bit
    assert len(full_result["losses"]) == STEPS
    assert cut_result["losses"] == full_result["losses"][:CUT]
    assert resumed_result["losses"] == full_result["losses"][CUT:]
    assert resumed_result["loss_history"] == full_result["losses"]

    # the restored state is the cut session's last state, on the run's device
    assert cut.ended is not None and resumed.restored is not None
    assert cut.ended["ema_updates"] == CUT
    assert_identical(resumed.restored, cut.ended, "restored")
    assert_on(resumed.restored, device)

    # data order: the resumed session trains on the uninterrupted run's batches, on the device
    assert sorted(resumed.batches) == list(range(CUT, STEPS))
    for step, batch in resumed.batches.items():
        assert_identical(batch, full.batches[step], f"batch of step {step}")
        assert all(t.device.type == device for t in batch.values())

    # the end: parameters, EMA averages, Adam moments and schedule of the uninterrupted run
    assert full.ended is not None and resumed.ended is not None
    assert full.ended["ema_updates"] == STEPS
    assert_identical(resumed.ended, full.ended, "end")
    assert_on(resumed.ended, device)
    # the final model is the EMA (copied into the model by finish, on the device)
    for name, p in resumed.raw_model.named_parameters():
        assert p.device.type == device and torch.equal(p, full.ended["ema"][name]), name

    if device == "cuda":  # a CUDA checkpoint resumed on the CPU (Accelerate maps it there)
        out = tmp_path / "on_cpu"
        shutil.copytree(tmp_path / "cut" / "checkpoints" / f"step_{CUT}",
                        out / "checkpoints" / f"step_{CUT}")  # fmt: skip
        on_cpu, on_cpu_result = _train(monkeypatch, "cpu", out, resume="latest")
        assert on_cpu.restored is not None
        assert_identical(on_cpu.restored, _on_cpu(cut.ended), "restored on the CPU")
        assert_on(on_cpu.restored, "cpu")
        # the same run on other hardware: float rounding differs, nothing else
        assert on_cpu_result["losses"] == pytest.approx(full_result["losses"][CUT:], rel=1e-3)


@CUDA
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_run_on_cuda_resumes_exactly(
    precision: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_accelerate
) -> None:
    """Under ``--mixed-precision`` on CUDA (fp16 with Accelerate's GradScaler, whose scale
    the checkpoint carries) the run trains in finite losses, and the resumed session is the
    rest of the uninterrupted one, bit for bit: losses, parameters, EMA, Adam moments, and
    under fp16 the scaler's state."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        kw = {"mixed_precision": precision}
        full, full_result = _train(monkeypatch, "cuda", tmp_path / "full", **kw)
        _train(monkeypatch, "cuda", tmp_path / "cut", stop_after=CUT, **kw)
        resumed, resumed_result = _train(
            monkeypatch, "cuda", tmp_path / "cut", resume="latest", **kw
        )
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    losses = full_result["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert resumed_result["losses"] == losses[CUT:]
    assert full.ended is not None and resumed.ended is not None
    assert_identical(resumed.ended, full.ended, "end")
    scalers = [t.accelerator.scaler for t in (full, resumed)]
    if precision == "fp16":
        assert all(s is not None for s in scalers)
        assert scalers[1].state_dict() == scalers[0].state_dict()
    else:
        assert scalers == [None, None]


@pytest.mark.parametrize("device", DEVICES)
def test_the_stale_checkpoint_count_is_reduced_on_the_run_device(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fresh-run check all-reduces its count on the run's device: NCCL, the backend of a
    multi-GPU launch, has no CPU collectives (a CPU tensor raises "No backend type associated
    with device type cpu"). Here the collective is faked: another rank has found one."""
    import torch.distributed as dist

    from dspzoo.core.parallel.mesh import SPMesh
    from dspzoo.core.train.resume import refuse_stale_checkpoints

    seen: list[torch.device] = []

    def another_rank_has_one(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append(tensor.device)
        tensor.fill_(1)

    monkeypatch.setattr(dist, "all_reduce", another_rank_has_one)
    mesh = SPMesh(world_size=2, rank=0, dp_size=1, sp_size=2, dp_rank=0, sp_rank=0)
    with pytest.raises(FileExistsError, match=r"\(1 on another machine\)"):
        refuse_stale_checkpoints(mesh, tmp_path, torch.device(device))
    assert [d.type for d in seen] == [device]

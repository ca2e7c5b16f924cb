"""The cost model's training step sends what a real training step sends: ``predict``'s bytes
per rank (the busiest) equal the tracer's over the domains' own training losses
(``TextTask.loss``, ``VideoTask.loss``, ``WeatherTask.loss``, called on tasks whose run
settings are set by hand).

One spawn of 3 gloo workers runs SP 2 (ranks 0, 1) and SP 3 (L = 11, T' = 5, S = 9, a 10 × 13
weather patch grid: nothing divisible by 2 or 3). The LMs (ByteLM, Mamba) and the video DiT
take their loss on each rank's shard (``gather_output=False``) and send no exit all-gather; the
weather transformer's MSE needs the replicated forecast, so its training step does send it.
Inference (``training=False``) gathers the output in every family.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import dspzoo.domains.mamba  # noqa: F401  (registers the families)
import dspzoo.domains.text  # noqa: F401
import dspzoo.domains.video  # noqa: F401
import dspzoo.domains.weather  # noqa: F401
from dspzoo.core import SeqParallel, trace_comm
from dspzoo.core.costmodel import comm_bytes, make_plan, predict
from dspzoo.core.costmodel.formulas import exit_gather_bytes
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.testing import run_distributed, sub_mesh
from dspzoo.core.train import Task
from dspzoo.domains.text.training import TextTask
from dspzoo.domains.video.codec import PixelUnshuffleCodec
from dspzoo.domains.video.diffusion import TIMESTEP_SCALE, FlowConfig
from dspzoo.domains.video.training import VideoTask
from dspzoo.domains.weather.training import WeatherTask
from dspzoo.zoo import create_model
from dspzoo.zoo.workloads import workload_for

TEXT = {"hidden": 24, "heads": 4, "depth": 2}
VIDEO = {"hidden": 32, "heads": 4, "depth": 2, "num_classes": 3, "cond_dim": 0}
WEATHER = {"grid": (37, 49), "patch": 4, "history": 3}
# (model, strategy): every attention method on the LM, the scan method DSP picks for Mamba
CASES = (
    ("bytelm-tiny", "dsp"),
    ("bytelm-tiny", "ulysses"),
    ("bytelm-tiny", "ring"),
    ("bytelm-tiny", "lss"),
    ("mambalm-tiny", "dsp"),
    ("stdit-tiny", "dsp"),
    ("stdit-tiny", "ulysses"),
    ("weathertx-tiny", "dsp"),
    ("weathertx-tiny", "ulysses"),
)
OVERRIDES = {
    "bytelm-tiny": TEXT,
    "mambalm-tiny": {},
    "stdit-tiny": VIDEO,
    "weathertx-tiny": WEATHER,
}


def _workload(name: str):
    """The workload of the model the workers build, as ``dspzoo plan`` describes it."""
    sizes: dict[str, Any] = {"seq_len": 11}
    if name == "stdit-tiny":
        sizes = {"frames": 5, "spatial": 6}
    elif name == "weathertx-tiny":
        sizes = {}
    return workload_for(name, batch=2, overrides=OVERRIDES[name], **sizes)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(name, **OVERRIDES[name])
    with torch.no_grad():  # zero-initialised heads and gates would hide nothing, but be safe
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def _inputs(name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A training batch as the family's task receives it, plus the inference call's inputs
    (``x``, ``t``, ``y`` for the video DiT: the latents its ``VideoTask.loss`` encodes)."""
    g = torch.Generator().manual_seed(1)
    if name in ("bytelm-tiny", "mambalm-tiny"):
        tokens = torch.randint(0, 256, (2, 12), generator=g)
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    if name == "stdit-tiny":
        video = torch.rand(2, 3, 5, 12, 12, generator=g) * 2 - 1  # 6 × 6 latents (factor 2)
        return {
            "video": video,
            "label": torch.tensor([0, 2]),
            "x": PixelUnshuffleCodec(2).encode(video),
            "t": torch.rand(2, generator=g),
        }
    c = model.config
    return {
        "x": torch.randn(2, c.history, len(c.variables), *c.grid, generator=g),
        "lead_time": torch.tensor([1.0, 3.0]),
        "target": torch.randn(2, len(c.variables), *c.grid, generator=g),
        "mask": torch.ones(2, len(c.variables), *c.grid),
    }


def _task(name: str, model: torch.nn.Module, mesh: SPMesh) -> Task:
    """The family's training task, its ``loss`` unchanged; what ``loss`` reads of the task's
    run (config, codec, latitude weights, accelerator) is set by hand instead of built from
    a dataset."""
    if name in ("bytelm-tiny", "mambalm-tiny"):  # the LMs train with the text Task
        return object.__new__(TextTask)
    unwrap = SimpleNamespace(unwrap_model=lambda m: m)
    if name == "stdit-tiny":
        video = object.__new__(VideoTask)
        video.cfg = SimpleNamespace(seed=0, class_dropout=0.1, global_batch=2)
        video.mesh, video.accelerator = mesh, unwrap
        video.codec, video.flow = PixelUnshuffleCodec(2), FlowConfig()
        return video
    weather = object.__new__(WeatherTask)
    weather.cfg = SimpleNamespace(seed=0)
    weather.data = SimpleNamespace(train=SimpleNamespace(num_static=0))
    weather.accelerator = unwrap
    weather.lat_weights = torch.linspace(0.5, 1.5, model.config.grid[0])
    return weather


def _inference(name: str, model: torch.nn.Module, batch: dict, sp: SeqParallel) -> None:
    """One forward returning the replicated output (the samplers', forecasts' and
    evaluations' call)."""
    with torch.no_grad():
        if name in ("bytelm-tiny", "mambalm-tiny"):
            model(batch["tokens"], sp=sp)
        elif name == "stdit-tiny":
            model(batch["x"], batch["t"] * TIMESTEP_SCALE, y=batch["label"], sp=sp)
        else:
            model(batch["x"], batch["lead_time"], None, sp=sp)


def _by_op(tracer) -> dict[str, int]:
    """Traced bytes sent by this rank, by collective (both phases)."""
    return {op: tracer.total_bytes(op) for op in {r.op for r in tracer.records}}


def _worker(rank: int, world: int) -> dict:
    meshes = {2: sub_mesh(2), 3: sub_mesh(3)}
    out: dict = {}
    for size, mesh in meshes.items():
        if mesh is None:
            continue
        for name, strategy in CASES:
            sp = SeqParallel(mesh, strategy)
            model = _model(name)
            batch = _inputs(name, model)
            with trace_comm() as tracer:
                _task(name, model, mesh).loss(model, batch, 0, sp).backward()
            assert any(p.grad is not None for p in model.parameters())
            with trace_comm() as forward:
                _inference(name, model.eval(), batch, sp)
            out[(name, strategy, size)] = (_by_op(tracer), _by_op(forward))
    return out


@pytest.fixture(scope="module")
def traced() -> list[dict]:
    return run_distributed(_worker, 3, timeout=280)


@pytest.mark.timeout(300)
def test_training_prediction_sends_what_the_training_step_sends(traced) -> None:
    """``predict(training=True)``'s bytes are the busiest rank's traced bytes of a training
    step (no exit all-gather where the loss runs on the shard), and ``training=False``'s are
    those of a forward that gathers the output. The one traced collective the cost model
    leaves out is the sharded loss's own all-reduce of its fp64 element count (``sp_mean``:
    8 bytes, the same under every plan)."""
    checked = 0
    for name, strategy in CASES:
        wl = _workload(name)
        for size in (2, 3):
            ranks = [r[(name, strategy, size)] for r in traced if (name, strategy, size) in r]
            assert len(ranks) == size
            what = f"{name} {strategy} SP {size}"
            count_sum = {"all_reduce": 2 * (size - 1) * 8 // size} if wl.loss_on_shard else {}
            for step, _ in ranks:
                assert {op: b for op, b in step.items() if op == "all_reduce"} == count_sum, what
            step = max(sum(b for op, b in t.items() if op != "all_reduce") for t, _ in ranks)
            forward = max(sum(f.values()) for _, f in ranks)
            assert predict(wl, strategy, size, training=True).bytes == step, what
            assert predict(wl, strategy, size, training=False).bytes == forward, what
            checked += 1
    assert checked == 2 * len(CASES)


def test_a_training_step_on_the_shard_counts_no_exit_gather() -> None:
    """At ``mamba2lm-130m`` scale the logits' exit gather would be nearly all of the bytes:
    a training step counts none; a forward (inference) does."""
    wl = workload_for("mamba2lm-130m", seq_len=65536)
    train, infer = predict(wl, "dsp", 2), predict(wl, "dsp", 2, training=False)
    logits = wl.batch * 65536 // 2 * wl.exit_width * wl.itemsize  # one rank's half, sent once
    assert train.bytes < 0.01 * logits <= infer.bytes
    weather = workload_for("weathertx-tiny", batch=2, overrides=WEATHER)
    plan = make_plan(weather, "dsp", 2)
    without = max(comm_bytes(weather, plan, 2, r, exit_gather=False).bytes() for r in range(2))
    gather = exit_gather_bytes(weather, plan, 2)
    assert gather > 0
    assert predict(weather, "dsp", 2).bytes - without == gather  # the weather MSE's gather

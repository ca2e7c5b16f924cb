"""Issue 18's test matrix on the models: every Mamba model × scan order × scan method at SP 2, 3
and 4 on shapes no SP size divides equals one process (outputs and every parameter gradient,
fp64), and every rank's traced bytes equal the cost model's plan.

What :mod:`tests.test_mamba_parallel` (DSP's own plans, one raster video under the scan
methods) and :mod:`tests.test_scan_methods` (bare mixers) leave out:

* the Mamba-1 and Mamba-2 LMs under state passing and under the head all-to-all (fp64);
* the video Mamba DiT with its default bidirectional scans, Mamba-1 and Mamba-2, in ``raster``
  order under both scan methods, and in the ``axial`` orders with every scan stage forced onto
  a scan method over its own (sharded) dim: ``t``, ``h`` (3 rows: an empty shard at SP 4)
  and ``w``, switching the sharded dim between them;
* the weather Mamba with its time and latitude scans (and, without ``periodic_lon``, its
  longitude scan) under the scan methods;
* bad input on every rank: a dtype or a token id differing on one rank, a raster scan over
  fewer frames than ranks (an empty segment), a wrong initial state, a scan order over a dim
  the model lacks, a checkpoint of another model class. Every rank raises a clear error and
  none waits in a collective.

``cross`` and ``zigzag`` orders, and the circular longitude scan, read their dims in an order a
shard cannot follow (a route permutation, a ring): their stages are ``generic`` and get their
dims whole (checked under DSP in :mod:`tests.test_mamba_parallel`); a scan method on them is
refused when the model is built. One spawn of 4 gloo workers runs every case (SP groups of 2,
3 and 4 ranks reused).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.costmodel import comm_bytes
from dspzoo.core.harness import call_with_sp, full_gradients, relative_error
from dspzoo.core.layers.mamba import MixerState
from dspzoo.core.parallel.comm import CollectiveInputError
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.methods.registry import get_method
from dspzoo.core.parallel.plan import Stage
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.strategies import get_strategy
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.core.parallel.validate import InputValidationError
from dspzoo.core.testing import run_distributed
from dspzoo.domains.mamba import (
    LM_CONFIGS,
    VIDEO_CONFIGS,
    WEATHER_CONFIGS,
    MambaLM,
    VideoMamba,
    WeatherMamba,
    lm_class,
)
from dspzoo.domains.mamba.layers import build_mixer
from dspzoo.domains.mamba.workload import (
    mamba_lm_workload,
    video_mamba_workload,
    weather_mamba_workload,
)
from dspzoo.zoo import CheckpointMismatchError, create_model, from_pretrained, save_pretrained
from dspzoo.zoo.pretrained import load_weights

TOLERANCE = 1e-9  # fp64 throughout
SP, A2A = "state_passing", "head_a2a"
SIZES = (2, 3, 4)

LM1 = replace(LM_CONFIGS["mambalm"]["tiny"], vocab_size=40, hidden_size=16, state_size=4)
LM2 = replace(LM_CONFIGS["mamba2lm"]["tiny"], vocab_size=40, chunk_size=4)  # 4 heads, 13 tokens
_VIDEO = dict(in_channels=3, hidden=16, head_dim=8, chunk_size=4, depth=1, num_classes=4)
VIDEO_AXIAL = replace(VIDEO_CONFIGS["tiny"], **_VIDEO, mlp_ratio=0.0)  # bidirectional (default)
VIDEO_RASTER = replace(VIDEO_AXIAL, orders=("raster(t,h,w)", "raster(t,h,w)"))
VIDEO_CROSS = replace(VIDEO_AXIAL, orders=("axial(t)", "cross(h,w)"))
# two variables: with one, the variable aggregation's query has a zero gradient (rounding only)
WEATHER = replace(WEATHER_CONFIGS["tiny"], grid=(10, 12), patch=2, hidden=16, depth=1,
                  head_dim=8, chunk_size=4, history=3, num_static=1,
                  variables=("t2m", "u10"))  # fmt: skip
WEATHER_LINE = replace(WEATHER, mixer="mamba1", periodic_lon=False)  # lon: a scan op stage


@dataclass(frozen=True)
class ModelCase:
    """One model with its scan stages forced onto ``methods`` (in stage order; ``()``: DSP's own
    plan) at the inputs ``inputs()``; ``workload`` the cost model's."""

    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    workload: Callable[[], object]
    methods: tuple[str, ...]


def _forced(stages: tuple[Stage, ...], methods: tuple[str, ...]) -> tuple[Stage, ...]:
    """``stages`` with the scan-op stages planned with ``methods`` in turn (none: as planned)."""
    if not methods:
        return stages
    todo = iter(methods)
    return tuple(replace(s, method=next(todo)) if s.op == "scan" else s for s in stages)


def _forced_workload(workload, methods: tuple[str, ...]):
    """``workload`` whose stages are :func:`_forced` (the plan the model runs is the one
    costed)."""
    period = _forced(workload.period, methods)
    by_name = {s.name: s for s in period}
    layers = tuple(
        tuple(replace(spec, stage=by_name[spec.stage.name]) for spec in layer)
        for layer in workload.layers
    )
    return replace(workload, period=period, layers=layers)


def _video_inputs() -> dict[str, torch.Tensor]:
    """Latents of 5 frames of 6 × 10, patch (1, 2, 2): tokens t × h × w = 5 × 3 × 5."""
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 3, 5, 6, 10, generator=g, dtype=torch.float64),
            "timestep": torch.tensor([3.0, 70.0], dtype=torch.float64),
            "y": torch.tensor([1, 3])}  # fmt: skip


def _weather_inputs() -> dict[str, torch.Tensor]:
    """History 3 on 5 × 6 patches."""
    g = torch.Generator().manual_seed(4)
    c = WEATHER
    return {"x": torch.randn(2, c.history, len(c.variables), *c.grid, generator=g, dtype=torch.float64),
            "lead_time": torch.tensor([1.0, 3.0], dtype=torch.float64),
            "static": torch.randn(2, c.num_static, *c.grid, generator=g, dtype=torch.float64)}  # fmt: skip


def _lm_inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(2))}


def _video_case(name: str, config, methods) -> ModelCase:
    return ModelCase(
        name, lambda: VideoMamba(config), _video_inputs,
        lambda: video_mamba_workload("videomamba", config, batch=2, frames=5, spatial=(6, 10),
                                     itemsize=8),
        methods,
    )  # fmt: skip


def _weather_case(name: str, config, methods) -> ModelCase:
    return ModelCase(
        name, lambda: WeatherMamba(config), _weather_inputs,
        lambda: weather_mamba_workload("weathermamba", config, batch=2, itemsize=8), methods,
    )  # fmt: skip


def _lm_case(config, method: str) -> ModelCase:
    family = ("mambalm", "mamba2lm")[config.version - 1]
    return ModelCase(
        f"{family} {method}", lambda: lm_class(config.version)(config), _lm_inputs,
        lambda: mamba_lm_workload(family, config, batch=2, seq_len=13, itemsize=8), (method,),
    )  # fmt: skip


CASES = (
    _lm_case(LM1, SP),
    _lm_case(LM1, A2A),
    _lm_case(LM2, SP),
    _lm_case(LM2, A2A),
    _video_case("videomamba mamba2 bi raster", VIDEO_RASTER, (SP, A2A)),
    _video_case("videomamba mamba1 bi raster", replace(VIDEO_RASTER, mixer="mamba1"), (A2A, SP)),
    # DSP's own plans for what tests/test_mamba_parallel.py runs with one mixer only
    _video_case(
        "videomamba mamba1 bi axial(t)+cross(h,w)", replace(VIDEO_CROSS, mixer="mamba1"), ()
    ),  # fmt: skip
    _weather_case("weathermamba mamba1 bi, lon not periodic", WEATHER_LINE, ()),
)


def _build(case: ModelCase, seed: int) -> torch.nn.Module:
    """The model in fp64, every parameter moved off its init (adaLN-Zero zeros most
    gradients), its scan stages forced; the same on every rank."""
    torch.manual_seed(seed)
    model = case.build().double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    model.STAGES = _forced(model.STAGES, case.methods)
    return model


def _run(model: torch.nn.Module, inputs: dict, sp: SeqParallel, seed: int) -> torch.Tensor:
    out = call_with_sp(model, inputs, sp)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2),
                         dtype=out.dtype)  # fmt: skip
    (out * weight).sum().backward()
    return out.detach()


def _traced(tracer) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for rec in tracer.records:
        entry = out.setdefault((rec.op, rec.phase), [0, 0])
        entry[0] += 1
        entry[1] += rec.bytes_sent
    return {k: tuple(v) for k, v in out.items()}


def _check(case: ModelCase, mesh: SPMesh, ref: tuple, seed: int) -> list[str]:
    """``case`` at SP ``mesh.sp_size`` against one process (``ref``: output, model)."""
    ref_out, ref_model = ref
    model = _build(case, seed)
    sp = SeqParallel(mesh, "dsp")
    workload = _forced_workload(case.workload(), case.methods)
    plan = get_strategy("dsp").plan(workload.dims, workload.lengths, model.STAGES, mesh.sp_size)
    where = f"{case.name} SP {mesh.sp_size} rank {mesh.sp_rank}"
    failures = []
    forced = [s for s in model.STAGES if s.op == "scan" and s.method]
    for stage in forced:  # the forced method runs over a sharded scanned dim
        if plan.method_for(stage.name) != stage.method or plan.sharded_for(stage.name) not in (
            stage.mixes
        ):
            failures.append(f"{where}: {stage.name} planned {plan}")
    with trace_comm() as tracer:
        out = _run(model, case.inputs(), sp, seed)
    grads = full_gradients(model, sp, mesh, False)
    if relative_error(out, ref_out) > TOLERANCE:
        failures.append(f"{where}: output error {relative_error(out, ref_out):.2e}")
    for name, p in ref_model.named_parameters():
        err = relative_error(grads[name], p.grad)
        if err > TOLERANCE:
            failures.append(f"{where}: gradient of {name} error {err:.2e}")
    want = comm_bytes(workload, "dsp", mesh.sp_size, mesh.sp_rank)
    expected = {k: tuple(v) for k, v in want.items() if v != [0, 0]}
    traced = _traced(tracer)
    if traced != expected:
        failures.append(f"{where}: traced {traced} != formula {expected}")
    return failures


# -- bad input on every rank ------------------------------------------------------------------
def _expect(where: str, error: type[Exception], words: tuple[str, ...], fn) -> list[str]:
    """``fn()`` must raise ``error`` with every one of ``words`` in its message."""
    try:
        fn()
    except error as exc:
        missing = [w for w in words if w not in str(exc)]
        return [f"{where}: message lacks {missing}: {exc}"] if missing else []
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        return [f"{where}: raised {type(exc).__name__} instead of {error.__name__}: {exc}"]
    return [f"{where}: nothing raised"]


def _bad_inputs(mesh: SPMesh, folder: Path) -> list[str]:
    """Bad input through the models and the scan methods: every rank raises, clearly."""
    n, r = mesh.sp_size, mesh.sp_rank
    where = f"SP {n} rank {r}"
    sp = SeqParallel(mesh, "dsp")
    failures = []
    # a dtype differing on the last rank, into each scan method: the agreement names it
    mixer = build_mixer("mamba2", 8, num_heads=4, head_dim=4, state_size=4, chunk_size=3)
    seq = shard_sizes(7, n)
    dtype = torch.float32 if r == n - 1 else torch.float64
    for method in (SP, A2A):
        x = torch.zeros(2, seq[r], 8, dtype=dtype)
        failures += _expect(f"{where} {method} dtype", CollectiveInputError,
                            ("dtype", f"rank {n - 1}"),
                            lambda m=method, x=x: get_method(m).scan(sp, mixer.to(x.dtype), x, seq))  # fmt: skip
    # a token id out of the vocabulary on the last rank only, into the LM: every rank refuses
    model = MambaLM(LM1)
    tokens = torch.full((2, 13), 40 if r == n - 1 else 0)
    failures += _expect(f"{where} lm tokens", InputValidationError,
                        (f"rank(s) [{n - 1}]", "must lie in [0, 40)"), lambda: model(tokens, sp))  # fmt: skip
    # fewer frames than ranks under a raster scan: a rank would hold an empty segment
    if n == 4:
        for method in (SP, A2A):
            video = _build(_video_case("3 frames", VIDEO_RASTER, (method, method)), 7)
            three = {k: v[:, :, :3] if k == "x" else v for k, v in _video_inputs().items()}
            failures += _expect(f"{where} {method} empty segment", ValueError,
                                ("at least one token", "[15, 15, 15, 0]", "at most 3"),
                                lambda v=video, i=three: call_with_sp(v, i, sp))  # fmt: skip
    # a wrong initial state: refused before any collective (every rank calls it alike)
    state = MixerState(conv=torch.zeros(2, 9, 3), ssm=torch.zeros(2, 4, 4, 4))
    failures += _expect(f"{where} state", ValueError, ("state must be conv",),
                        lambda: mixer.float()(torch.zeros(2, 5, 8), state=state))  # fmt: skip
    # a scan order over a dim the model lacks, in the model and in a scan over the activation
    failures += _expect(f"{where} order", ValueError, ("['x']", "does not have", "'t', 'h', 'w'"),
                        lambda: VideoMamba(replace(VIDEO_AXIAL, orders=("axial(x)",))))  # fmt: skip
    # a checkpoint of another model class: the Mamba-2 LM's folder loaded as a Mamba-1 LM
    failures += _expect(f"{where} checkpoint", CheckpointMismatchError,
                        ("mamba2lm", "'mambalm' was expected"),
                        lambda: from_pretrained(folder, expected_family="mambalm"))  # fmt: skip
    failures += _expect(f"{where} init-from", CheckpointMismatchError,  # what --init-from calls
                        ("'mamba2lm'", "the model is 'mambalm'"),
                        lambda: load_weights(MambaLM(LM1), folder))  # fmt: skip
    return failures


def _worker(rank: int, world: int, folder: str) -> list[str]:
    torch.set_num_threads(1)
    meshes: dict[int, SPMesh | None] = {}
    for n in SIZES:
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))
        meshes[n] = SPMesh(world, rank, 1, n, 0, rank, sp_group=group) if rank < n else None
    waiting = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=240))
    failures: list[str] = []
    for i, case in enumerate(CASES):
        seed = 100 + 10 * i
        ref_model = _build(case, seed)
        ref = (_run(ref_model, case.inputs(), SeqParallel(), seed), ref_model)
        for n in SIZES:
            if meshes[n] is not None:
                failures += _check(case, meshes[n], ref, seed)
            dist.barrier(group=waiting)
    for n in SIZES:
        if meshes[n] is not None:
            failures += _bad_inputs(meshes[n], Path(folder))
        dist.barrier(group=waiting)
    return failures


@pytest.mark.timeout(600)
def test_mamba_models_under_scan_methods_equal_one_process_at_sp_2_3_4(tmp_path: Path) -> None:
    save_pretrained(create_model("mamba2lm-tiny"), tmp_path / "mamba2")
    results = run_distributed(_worker, 4, str(tmp_path / "mamba2"), timeout=580)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:30])


def test_routes_and_rings_refuse_a_scan_method() -> None:
    """``cross`` / ``zigzag`` stages and the circular longitude scan are ``generic``: forcing a
    scan method on them is refused with the reason, not run wrong."""
    stages = VideoMamba(replace(VIDEO_AXIAL, orders=("cross(h,w)", "zigzag(t,h,w)"))).STAGES
    assert [s.op for s in stages] == ["generic", "generic"]
    lon = WeatherMamba(WEATHER).STAGES[2]
    assert lon.name == "lon" and lon.op == "generic"
    for stage in (*stages, lon):
        with pytest.raises(ValueError, match="does not run"):
            replace(stage, method=SP)

"""Mamba models under sequence parallelism equal one process (outputs and every parameter
gradient) at SP 2, 3 and 4 on shapes no SP size divides, with the traced bytes equal to the
cost model's plan (core/harness.check_model: gloo workers spawned inside pytest, timeouts)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from dspzoo.core.harness import check_model
from dspzoo.core.parallel.plan import Stage
from dspzoo.core.parallel.strategies import get_strategy
from dspzoo.domains.mamba import LM_CONFIGS, SCAN_OP, VIDEO_CONFIGS, MambaLM, VideoMamba
from dspzoo.domains.mamba.video import SEQ_DIMS
from dspzoo.domains.mamba.workload import mamba_lm_workload, video_mamba_workload

VIDEO = dict(in_channels=3, hidden=16, head_dim=8, chunk_size=8, depth=1, num_classes=4)
AXIAL = replace(VIDEO_CONFIGS["tiny"], **VIDEO, bidirectional=False)
AXIAL_MAMBA1 = replace(AXIAL, mixer="mamba1", bidirectional=True)  # both directions
CROSS = replace(VIDEO_CONFIGS["tiny-cross"], **VIDEO, bidirectional=False)
RASTER = replace(VIDEO_CONFIGS["tiny-raster"], **VIDEO, bidirectional=False)
ZIGZAG = replace(VIDEO_CONFIGS["tiny-zigzag"], **VIDEO, bidirectional=False)
LM = replace(LM_CONFIGS["mamba2lm"]["tiny"], chunk_size=8)
SCAN_METHODS = ("state_passing", "head_a2a")


def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter off its init (adaLN-Zero would make most gradients zero)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def make_axial() -> VideoMamba:
    return _perturb(VideoMamba(AXIAL))


def make_axial_mamba1() -> VideoMamba:
    return _perturb(VideoMamba(AXIAL_MAMBA1))


def make_cross() -> VideoMamba:
    return _perturb(VideoMamba(CROSS))


def make_raster() -> VideoMamba:
    return _perturb(VideoMamba(RASTER))


def make_zigzag() -> VideoMamba:
    return _perturb(VideoMamba(ZIGZAG))


def make_lm() -> MambaLM:
    from dspzoo.domains.mamba import Mamba2LM

    return _perturb(Mamba2LM(LM))


def video_inputs() -> dict[str, torch.Tensor]:
    """5 frames of 6 × 10 latents, patch (1, 2, 2): tokens 5 × 3 × 5."""
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(2, 3, 5, 6, 10, generator=g),
        "timestep": torch.tensor([3.0, 70.0]),
        "y": torch.tensor([1, 3]),
    }


def lm_inputs() -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))}


def _video_workload(config):
    return video_mamba_workload("videomamba", config, batch=2, frames=5, spatial=(6, 10))


def test_axial_plan_switches_between_scan_axes():
    """DSP plans the axial orders like axial attention: every scan stage runs locally."""
    stages = VideoMamba(AXIAL).STAGES
    for sp_size in (2, 3, 4):
        plan = get_strategy("dsp").plan(SEQ_DIMS, (5, 3, 5), stages, sp_size)
        assert [step.stage for step in plan.steps] == ["scan0", "scan1", "scan2", "mlp"]
        for step in plan.steps:
            assert step.sharded not in step.mixes and step.method == "local", str(plan)
        assert plan.switches_per_period == 2, str(plan)  # t -> h|w -> t: two, as axial attention


@pytest.mark.parametrize(
    "factory, config", [(make_axial, AXIAL), (make_axial_mamba1, AXIAL_MAMBA1)]
)
@pytest.mark.timeout(600)
def test_video_mamba_axial_under_dsp_equals_one_process(factory, config):
    check_model(factory, video_inputs, strategies=["dsp"], workload=_video_workload(config),
                timeout=560)  # fmt: skip


@pytest.mark.timeout(600)
def test_video_mamba_axial_under_embedded_methods_equals_one_process():
    check_model(make_axial, video_inputs, strategies=["ulysses", "ring"], sp_sizes=(2, 3),
                workload=_video_workload(AXIAL), timeout=560)  # fmt: skip


@pytest.mark.timeout(600)
def test_video_mamba_cross_under_dsp_equals_one_process():
    check_model(make_cross, video_inputs, strategies=["dsp"], workload=_video_workload(CROSS),
                timeout=560)  # fmt: skip


@pytest.mark.timeout(600)
def test_mamba_lm_under_dsp_equals_one_process():
    """DSP plans the 1-D scan stage with a scan method (the sequence stays sharded)."""
    check_model(make_lm, lm_inputs, strategies=["dsp"], timeout=560,
                workload=mamba_lm_workload("mamba2lm", LM, batch=2, seq_len=13))  # fmt: skip


def make_lm_checkpointed() -> MambaLM:
    from dspzoo.domains.mamba import Mamba2LM

    return _perturb(Mamba2LM(replace(LM, checkpoint=True)))


@pytest.mark.timeout(600)
def test_checkpointed_mamba_lm_under_dsp_equals_one_process():
    """Activation checkpointing recomputes each layer in backward, after the region closed: the
    recomputation must scan the same segment by the same method (state passing) as forward.
    (No bytes check: the recomputation repeats the forward's halo and summary exchanges.)"""
    check_model(make_lm_checkpointed, lm_inputs, strategies=["dsp"], timeout=560)


def test_mamba_lm_workload_describes_the_model():
    wl = mamba_lm_workload("mamba2lm", LM, batch=2, seq_len=13)
    assert wl.dims == ("l",) and wl.lengths == (13,) and wl.depth == LM.num_hidden_layers
    assert [spec.name for layer in wl.layers for spec in layer] == ["scan"] * wl.depth
    assert wl.extra["scan"] == {"inner": 64, "state": 8, "heads": 4, "conv": 4, "routes": 1}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("factory", [make_raster, make_zigzag])
def test_video_mamba_flattened_orders_under_dsp_equal_one_process(factory):
    """raster(t,h,w) / zigzag(t,h,w) mix every dim: the scan stage gets the grid whole."""
    check_model(factory, video_inputs, strategies=["dsp"], timeout=560)


# -- scan methods over a sharded scanned dim (issue 18: the models on the scan op kind) ---------
RASTER2 = replace(RASTER, orders=("raster(t,h,w)", "raster(t,h,w)"), mlp_ratio=0.0)


def _forced(stages: tuple[Stage, ...], methods: tuple[str, ...]) -> tuple[Stage, ...]:
    """``stages`` with the scan stages planned with ``methods`` (in turn): a sharded scan."""
    scans = iter(methods)
    return tuple(replace(s, method=next(scans)) if s.op == "scan" else s for s in stages)


def _forced_workload(workload, methods: tuple[str, ...]):
    """``workload`` whose stages are :func:`_forced` (the cost model plans what the model runs)."""
    period = _forced(workload.period, methods)
    by_name = {s.name: s for s in period}
    layers = tuple(
        tuple(replace(spec, stage=by_name[spec.stage.name]) for spec in layer)
        for layer in workload.layers
    )
    return replace(workload, period=period, layers=layers)


def make_lm_forced(method: str) -> MambaLM:
    model = make_lm()
    model.STAGES = _forced(model.STAGES, (method,))
    return model


def make_raster_both_methods() -> VideoMamba:
    """Two raster scans per layer: the first by state passing, the second by head all-to-all."""
    model = _perturb(VideoMamba(RASTER2))
    model.STAGES = _forced(model.STAGES, SCAN_METHODS)
    return model


def test_scan_stages_get_the_scan_op_kind():
    """Axial and raster stages are ``scan`` stages; cross, zigzag routes stay ``generic``."""
    assert SCAN_OP == "scan"
    ops = {o: VideoMamba(replace(RASTER, orders=(o,))).STAGES[0].op for o in
           ("axial(t)", "raster(t,h,w)", "cross(h,w)", "zigzag(t,h,w)")}  # fmt: skip
    assert ops == {"axial(t)": "scan", "raster(t,h,w)": "scan", "cross(h,w)": "generic",
                   "zigzag(t,h,w)": "generic"}  # fmt: skip
    assert make_lm().STAGES[0].op == "scan"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", SCAN_METHODS)
def test_mamba_lm_under_scan_methods_equals_one_process(method):
    """The 1-D LM with its scan over the sharded sequence: state passing / head all-to-all."""
    workload = _forced_workload(mamba_lm_workload("mamba2lm", LM, batch=2, seq_len=13), (method,))
    check_model(partial(make_lm_forced, method), lm_inputs, strategies=["dsp"],
                workload=workload, timeout=560)  # fmt: skip


@pytest.mark.timeout(600)
def test_video_mamba_raster_under_scan_methods_equals_one_process():
    """raster(t,h,w) over the sharded ``t`` (outermost): one stage per method, one spawn."""
    workload = _forced_workload(_video_workload(RASTER2), SCAN_METHODS)
    check_model(make_raster_both_methods, video_inputs, strategies=["dsp"], workload=workload,
                timeout=560)  # fmt: skip

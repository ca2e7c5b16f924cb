"""The scan methods and Mamba mixers in the cost model (issue 18): FLOPs against torch's own
FLOP counter and a hand count, and the activation memory state passing adds against the
tensors autograd really saves (gloo workers at SP 2 and 3)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from dspzoo.core.costmodel.formulas import activation_bytes, forward_flops, stage_flops
from dspzoo.core.layers.mamba import Mamba1Config, Mamba1Mixer, Mamba2Config, Mamba2Mixer
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.methods.registry import get_method
from dspzoo.core.parallel.methods.scan import mixer_saved_elements
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.trace import SavedTensorMeter
from dspzoo.core.testing import run_distributed
from dspzoo.domains.mamba import (
    HYBRID_CONFIGS,
    LM_CONFIGS,
    VIDEO_CONFIGS,
    WEATHER_CONFIGS,
    VideoMamba,
    WeatherMamba,
)
from dspzoo.domains.mamba.hybrid import HybridLM
from dspzoo.domains.mamba.lm import Mamba2LM, MambaLM
from dspzoo.domains.mamba.workload import (
    head_a2a_saved,
    hybrid_lm_workload,
    mamba_lm_workload,
    mixer_flops_per_token,
    video_mamba_workload,
    weather_mamba_workload,
)

HIDDEN, LENGTH = 16, 64
MAMBA1 = dict(state_size=4, bidirectional=True)
MAMBA2 = dict(state_size=4, num_heads=4, head_dim=8, n_groups=2, chunk_size=8)


def _counted(mixer: torch.nn.Module) -> dict[str, float]:
    """torch's FLOP counts (matmuls and convolutions) of one forward, per token, by module."""
    with FlopCounterMode(display=False) as counter:
        mixer(torch.randn(1, LENGTH, HIDDEN))
    return {k: sum(v.values()) / LENGTH for k, v in counter.get_flop_counts().items()}


def test_mamba1_flops_equal_torch_counter_and_the_hand_count() -> None:
    mixer = Mamba1Mixer(Mamba1Config(hidden_size=HIDDEN, **MAMBA1))
    counted, ours = _counted(mixer), mixer_flops_per_token(mixer.config)
    # by hand: D = 32, N = 4, dt rank 1, K = 4, two directions
    in_proj, out_proj = 2 * 16 * 64, 2 * 32 * 16
    x_proj, dt_proj = 2 * 32 * (1 + 2 * 4), 2 * 1 * 32
    assert ours == {
        "projections": in_proj + out_proj + 2 * (x_proj + dt_proj),
        "conv": 2 * (2 * 4 * 32),
        "scan": 2 * (9 * 32 * 4),
    }
    assert counted["Mamba1Mixer.in_proj"] == in_proj
    assert counted["Mamba1Mixer.x_proj"] == counted["Mamba1Mixer.x_proj_b"] == x_proj
    # torch counts every matmul and the conv; the scan is elementwise (uncounted there)
    assert counted["Global"] == ours["projections"] + ours["conv"]


def test_mamba2_flops_against_torch_counter_and_the_hand_count() -> None:
    mixer = Mamba2Mixer(Mamba2Config(hidden_size=HIDDEN, **MAMBA2))
    counted, ours = _counted(mixer), mixer_flops_per_token(mixer.config)
    # by hand: D = 32, N = 4, G = 2, H = 4, Q = 8, conv over D + 2GN = 48 channels
    in_proj, out_proj = 2 * 16 * (2 * 32 + 2 * 2 * 4 + 4), 2 * 32 * 16
    ssd = 2 * 8 * 2 * 4 + 2 * 8 * 32 + 4 * 32 * 4
    assert ours == {"projections": in_proj + out_proj, "conv": 2 * 4 * 48, "scan": ssd}
    assert counted["Mamba2Mixer.in_proj"] == in_proj
    assert counted["Mamba2Mixer.out_proj"] == out_proj
    # the chunked SSD is matmuls here: torch's count of the whole mixer is within 10 % of ours
    total = sum(ours.values())
    assert abs(counted["Global"] / total - 1) < 0.10, (counted["Global"], total)


def test_the_cost_model_counts_the_scan_stages() -> None:
    """A hybrid's scan stage costs its mixer's FLOPs (it was 0 before), its attention stage
    the attention's."""
    wl = hybrid_lm_workload("hybridlm-tiny", HYBRID_CONFIGS["tiny"], batch=2, seq_len=100)
    scan = next(spec for layer in wl.layers for spec in layer if spec.scan is not None)
    cfg = HYBRID_CONFIGS["tiny"]
    mixer_config = Mamba2Config(hidden_size=cfg.hidden_size, **cfg.mixer_options())
    per_token = sum(mixer_flops_per_token(mixer_config).values())
    assert scan.scan.flops_per_token == per_token > 0
    assert stage_flops(wl, scan).forward == 2 * 100 * per_token


def _model_flops(model: torch.nn.Module, inputs: dict, workload) -> tuple[float, float]:
    """(the cost model's forward FLOPs, torch's count of one forward of ``model``)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return forward_flops(workload).forward, float(counter.get_total_flops())


@pytest.mark.parametrize("order", ["axial(t)", "raster(t,h,w)", "cross(h,w)", "zigzag(t,h,w)"])
def test_every_scan_order_costs_its_mixers(order: str) -> None:
    """A scan stage costs its mixers in every order, generic ones included (cross: four routes,
    each its own mixer; zigzag: one, as raster), within 10 % of torch's counter."""
    config = replace(VIDEO_CONFIGS["tiny"], depth=1, orders=(order,))
    model = VideoMamba(config)
    inputs = {"x": torch.randn(1, config.in_channels, 4, 8, 8), "timestep": torch.tensor([5.0]),
              "y": torch.tensor([1])}  # fmt: skip
    workload = video_mamba_workload("videomamba", config, batch=1, frames=4, spatial=8)
    ours, counted = _model_flops(model, inputs, workload)
    assert abs(ours / counted - 1) < 0.10, (order, ours, counted)


@pytest.mark.parametrize("periodic", [True, False])
def test_the_circular_longitude_scan_costs_a_scan_per_column(periodic: bool) -> None:
    """The weather Mamba's ring scan reads the whole ring from every column: X scans per token."""
    config = replace(WEATHER_CONFIGS["tiny"], depth=1, grid=(8, 16), periodic_lon=periodic)
    inputs = {"x": torch.randn(1, config.history, len(config.variables), *config.grid),
              "lead_time": torch.tensor([1.0])}  # fmt: skip
    workload = weather_mamba_workload("weathermamba", config, batch=1)
    ours, counted = _model_flops(WeatherMamba(config), inputs, workload)
    assert abs(ours / counted - 1) < 0.10, (periodic, ours, counted)


# -- activation memory of state passing ------------------------------------------------------
def _mixers() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "mamba1": Mamba1Mixer(Mamba1Config(hidden_size=HIDDEN, state_size=4)),
        "mamba1_bi": Mamba1Mixer(Mamba1Config(hidden_size=HIDDEN, **MAMBA1)),
        "mamba2": Mamba2Mixer(Mamba2Config(hidden_size=HIDDEN, **MAMBA2)),
    }


def _saved(fn, mixer: torch.nn.Module, x: torch.Tensor) -> float:
    with SavedTensorMeter(mixer.parameters()) as meter:
        fn(x)
    return meter.bytes / x.element_size()


def _memory_worker(rank: int, world: int) -> dict:
    """Extra elements state passing saves per rank, at two lengths, against the formula."""
    torch.set_num_threads(1)
    out = {}
    for n in (2, 3):
        sub = dist.group.WORLD if n == world else dist.new_group([0, 1])
        if rank >= n:
            continue
        sp = SeqParallel(SPMesh(world, rank, 1, n, 0, rank, sp_group=sub))
        method = get_method("state_passing")
        for kind, mixer in _mixers().items():
            for length in (48, 96):  # whole chunks of 8 per rank
                seq = shard_sizes(length, n)
                x = torch.randn(2, seq[rank], HIDDEN)
                extra = _saved(partial(method.scan, sp, mixer, seq_lengths=seq), mixer, x)
                extra -= _saved(mixer, mixer, x)  # one process on the same local tokens
                shape = mixer.scan_shape(2, tuple(seq), 4)
                out[(kind, n, length)] = (extra, method.scan_saved_elements(shape, rank))
    return out


@pytest.mark.timeout(300)
def test_state_passing_activation_formula_against_saved_tensors() -> None:
    """Per token (the slope over two lengths) the formula is exact; in all (the per-line
    summaries included), within 20 % at these short segments (24 to 48 tokens; at two ranks
    the exclusive scan keeps less than the formula's ``N·(4·state + decay)`` per line)."""
    results = run_distributed(_memory_worker, 3, timeout=280)
    checked = 0
    for rank, per_rank in enumerate(results):
        for (kind, n, length), (measured, formula) in per_rank.items():
            if length != 96:
                continue
            short_measured, short_formula = per_rank[(kind, n, 48)]
            where = (kind, n, rank)
            assert measured - short_measured == formula - short_formula, where
            assert abs(formula / measured - 1) < 0.20, (where, measured, formula)
            checked += 1
    assert checked == 3 * (2 + 3)


# -- activation memory of the scan stages ------------------------------------------------------
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("length", [5, 16, 40, 77])
def test_mixer_saved_elements_match_the_saved_tensors(length: int, bidirectional: bool) -> None:
    """Every term of the mixers' counts (``ScanShape.saved_*``) against what autograd keeps:
    lines shorter than a chunk, one chunk, several (the einsums' copies), a ragged last chunk;
    within 3 % (what is left: tensors of the parameters alone, such as ``A``, once per call:
    8 lines make them small)."""
    torch.manual_seed(0)
    mixers = (
        Mamba1Mixer(Mamba1Config(hidden_size=HIDDEN, state_size=4, bidirectional=bidirectional,
                                 time_step_rank=3)),
        Mamba2Mixer(Mamba2Config(hidden_size=HIDDEN, **{**MAMBA2, "chunk_size": 16},
                                 bidirectional=bidirectional)),
    )  # fmt: skip
    for mixer in mixers:
        x = torch.randn(8, length, HIDDEN)
        measured = _saved(mixer, mixer, x)
        formula = 8 * mixer_saved_elements(mixer.scan_shape(8, (length,)), length)
        assert abs(formula / measured - 1) < 0.03, (type(mixer).__name__, measured, formula)


BATCH = 2


def _memory_cases() -> dict[str, tuple]:
    """``name: (model, inputs, workload)`` of the tiny Mamba models (one forward each)."""
    torch.manual_seed(0)
    lm1, lm2 = LM_CONFIGS["mambalm"]["tiny"], LM_CONFIGS["mamba2lm"]["tiny"]
    video, weather = VIDEO_CONFIGS["tiny"], WEATHER_CONFIGS["tiny"]
    tokens = torch.randint(0, lm1.vocab_size, (BATCH, 100))
    return {
        "mambalm-tiny": (MambaLM(lm1), {"tokens": tokens},
                         mamba_lm_workload("mambalm-tiny", lm1, batch=BATCH, seq_len=100)),
        "mamba2lm-tiny": (Mamba2LM(lm2), {"tokens": tokens},
                          mamba_lm_workload("mamba2lm-tiny", lm2, batch=BATCH, seq_len=100)),
        # t × h × w = 8 × 8 × 8 tokens (patch 1 × 2 × 2)
        "videomamba-tiny": (
            VideoMamba(video),
            {"x": torch.randn(BATCH, video.in_channels, 8, 16, 16),
             "timestep": torch.tensor([5.0, 70.0]), "y": torch.tensor([1, 2])},
            video_mamba_workload("videomamba-tiny", video, batch=BATCH, frames=8, spatial=16),
        ),
        # history 2 on 8 × 16 patches, the longitude scan circular (16 scans per token)
        "weathermamba-tiny": (
            WeatherMamba(weather),
            {"x": torch.randn(BATCH, weather.history, len(weather.variables), *weather.grid),
             "lead_time": torch.tensor([1.0, 3.0])},
            weather_mamba_workload("weathermamba-tiny", weather, batch=BATCH),
        ),
    }  # fmt: skip


def _model_saved_bytes(model: torch.nn.Module, inputs: dict, sp: SeqParallel) -> int:
    with SavedTensorMeter(model.parameters()) as meter:
        model(**inputs, sp=sp)
    return meter.bytes


def test_activation_bytes_within_10_percent_of_the_saved_tensors_at_sp_1() -> None:
    """``activation_bytes`` of the four tiny Mamba models against one process's forward (the
    scan stages counted: before, the video model's formula was 12 × under)."""
    for name, (model, inputs, workload) in _memory_cases().items():
        measured = _model_saved_bytes(model, inputs, SeqParallel())
        formula = activation_bytes(workload)
        assert abs(formula / measured - 1) < 0.10, (name, measured, formula)


def _sp2_memory_worker(rank: int, world: int) -> dict:
    """Saved bytes per rank at SP 2 under DSP's plan (the LMs: state passing; the video model:
    local axial scans) and the LM under the head all-to-all."""
    torch.set_num_threads(1)
    mesh = SPMesh(world, rank, 1, world, 0, rank, sp_group=dist.group.WORLD)
    cases = {k: v for k, v in _memory_cases().items() if k != "weathermamba-tiny"}
    out = {}
    for name, (model, inputs, _workload) in cases.items():
        out[(name, "dsp")] = _model_saved_bytes(model, inputs, SeqParallel(mesh, "dsp"))
    model, inputs, _workload = cases["mamba2lm-tiny"]
    model.STAGES = tuple(replace(s, method="head_a2a") for s in model.STAGES)
    out[("mamba2lm-tiny", "head_a2a")] = _model_saved_bytes(model, inputs, SeqParallel(mesh, "dsp"))
    return out


@pytest.mark.timeout(120)
def test_activation_bytes_within_10_percent_of_the_saved_tensors_at_sp_2() -> None:
    """Per rank at SP 2: the LMs under state passing (its summaries and correction counted by
    the method's ``scan_saved_elements``), the video model's local axial scans and the head
    all-to-all (its own count, ``HeadScanSaved``: within 0.1 %; counted as the local tokens'
    before, 4.5 % under) within 10 % (measured: 3 % the worst)."""
    results = run_distributed(_sp2_memory_worker, 2, timeout=110)
    cases = _memory_cases()
    checked = 0
    for rank, per_rank in enumerate(results):
        for (name, method), measured in per_rank.items():
            workload = cases[name][2]
            if method != "dsp":
                period = tuple(replace(s, method=method) for s in workload.period)
                layers = tuple(
                    tuple(replace(spec, stage=replace(spec.stage, method=method)) for spec in layer)
                    for layer in workload.layers
                )
                workload = replace(workload, period=period, layers=layers)
            formula = activation_bytes(workload, "dsp", 2, rank)
            assert abs(formula / measured - 1) < 0.10, (name, method, rank, measured, formula)
            checked += 1
    assert checked == 2 * 4


# -- the hybrid LM's attention layers ---------------------------------------------------------
def _hybrid_case(rope: bool, length: int = 100) -> tuple:
    """hybridlm-tiny (2 Mamba-2 layers, 2 attention layers of 4 query and 2 K/V heads)."""
    torch.manual_seed(0)
    config = replace(HYBRID_CONFIGS["tiny"], rope=rope)
    tokens = torch.randint(0, config.vocab_size, (BATCH, length))
    workload = hybrid_lm_workload("hybridlm-tiny", config, batch=BATCH, seq_len=length)
    return HybridLM(config), {"tokens": tokens}, workload


def test_hybrid_attention_layers_are_priced_as_pre_norm_blocks_at_sp_1() -> None:
    """The attention layers are the text domain's pre-norm blocks: their stages say so
    (``pre_norm``), and the model's activation bytes are within 3 % of the saved tensors
    (priced as DiT blocks they were 8.9 % over)."""
    for rope in (False, True):
        model, inputs, workload = _hybrid_case(rope)
        attention = [s for layer in workload.layers for s in layer if s.attention or s.mlp]
        assert attention and all(s.pre_norm for s in attention)
        measured = _model_saved_bytes(model, inputs, SeqParallel())
        formula = activation_bytes(workload)
        assert abs(formula / measured - 1) < 0.03, (rope, measured, formula)


def _hybrid_sp2_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    mesh = SPMesh(world, rank, 1, world, 0, rank, sp_group=dist.group.WORLD)
    out = {}
    for rope in (False, True):
        model, inputs, _workload = _hybrid_case(rope, length=101)
        out[rope] = _model_saved_bytes(model, inputs, SeqParallel(mesh, "dsp"))
    return out


@pytest.mark.timeout(120)
def test_hybrid_attention_layers_are_priced_as_pre_norm_blocks_at_sp_2() -> None:
    """Per rank at SP 2 (101 tokens: 51 and 50) under DSP's plan (the scan stages by state
    passing, the attention by its method): within 3 % of the saved tensors."""
    results = run_distributed(_hybrid_sp2_worker, 2, timeout=110)
    for rank, per_rank in enumerate(results):
        for rope, measured in per_rank.items():
            formula = activation_bytes(_hybrid_case(rope, length=101)[2], "dsp", 2, rank)
            assert abs(formula / measured - 1) < 0.03, (rank, rope, measured, formula)


# -- activation memory of the head all-to-all --------------------------------------------------
def _head_mixers() -> dict[str, torch.nn.Module]:
    """The mixers above, and a Mamba-2 whose head dim, state and chunk all differ and whose 6
    heads split unevenly (2, 2, 1, 1 at SP 4: ranks with a single head)."""
    torch.manual_seed(0)
    odd = dict(state_size=3, num_heads=6, head_dim=5, n_groups=2, chunk_size=7)
    return {
        **_mixers(),
        "mamba2_odd": Mamba2Mixer(Mamba2Config(hidden_size=15, **odd)),
        "mamba2_odd_bi": Mamba2Mixer(Mamba2Config(hidden_size=15, **odd, bidirectional=True)),
    }


def _head_memory_worker(rank: int, world: int) -> dict:
    """Saved elements per rank under the head all-to-all against ``HeadScanSaved``, per mixer
    (uneven lengths) and for the tiny LMs, at SP 2 and 4."""
    torch.set_num_threads(1)
    out = {}
    method = get_method("head_a2a")
    cases = _memory_cases()
    for n in (2, 4):
        sub = dist.group.WORLD if n == world else dist.new_group([0, 1])
        if rank >= n:
            continue
        mesh = SPMesh(world, rank, 1, n, 0, rank, sp_group=sub)
        sp = SeqParallel(mesh)
        for kind, mixer in _head_mixers().items():
            for length in (41, 96):
                seq = shard_sizes(length, n)
                x = torch.randn(2, seq[rank], mixer.config.hidden_size)
                measured = _saved(partial(method.scan, sp, mixer, seq_lengths=seq), mixer, x)
                heads = mixer.scan_shape(2, tuple(seq)).heads
                formula = 2 * head_a2a_saved(mixer.config).elements(seq, heads, rank)
                out[(kind, n, length)] = (measured, formula)
        for name in ("mambalm-tiny", "mamba2lm-tiny"):
            model, inputs, workload = cases[name]
            model.STAGES = tuple(replace(s, method="head_a2a") for s in model.STAGES)
            measured = _model_saved_bytes(model, inputs, SeqParallel(mesh, "dsp"))
            formula = activation_bytes(_forced(workload, "head_a2a"), "dsp", n, rank)
            out[(name, n, 100)] = (measured, formula)
    return out


def _forced(workload, method: str):
    """``workload`` with every stage's method forced to ``method``."""
    period = tuple(replace(s, method=method) for s in workload.period)
    layers = tuple(
        tuple(replace(spec, stage=replace(spec.stage, method=method)) for spec in layer)
        for layer in workload.layers
    )
    return replace(workload, period=period, layers=layers)


@pytest.mark.timeout(300)
def test_head_a2a_activation_formula_against_saved_tensors() -> None:
    """The head all-to-all's own count: the projections and conv on the local tokens, the scan
    on the whole sequence for the rank's heads (``HeadScanSaved``). Every mixer, both
    directions, uneven lengths and head splits, at SP 2 and 4 on every rank: within 1.5 %
    (what is left: masks and tensors of the parameters alone, once per call); the LMs within
    1 % (before: counted as the local tokens', 4.5 % under at SP 2)."""
    results = run_distributed(_head_memory_worker, 4, timeout=280)
    checked = 0
    for rank, per_rank in enumerate(results):
        for (kind, n, length), (measured, formula) in per_rank.items():
            limit = 0.01 if kind.endswith("lm-tiny") else 0.015
            assert abs(formula / measured - 1) < limit, (kind, n, length, rank, measured, formula)
            checked += 1
    assert checked == (2 + 4) * (len(_head_mixers()) * 2 + 2)

"""The cost model: its byte formulas equal the tracer, its memory is within 10 % of the meter,
``strategy="auto"`` follows it, and the cluster predictions behave.

One 3-process spawn runs STDiT-tiny (a full 3-D attention layer every 2nd layer, token grid
T' = 5, S = 9: nothing divisible by 2 or 3, 4 heads: not divisible by 3) and ByteLM-tiny
(L = 11, causal; MHA and GQA) under every strategy at SP 2 (ranks 0, 1) and SP 3, traces one
forward + backward, and compares every ``(op, phase)`` count and byte total on every rank with
:func:`dspzoo.core.costmodel.comm_bytes`. The same spawn measures activation memory with
:class:`SavedTensorMeter` at SP 2 and runs ``strategy="auto"`` against one process.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import dspzoo.domains.text  # noqa: F401  (registers the families)
import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SeqParallel, trace_comm
from dspzoo.core.costmodel import (
    CLUSTERS,
    activation_bytes,
    auto_plan,
    comm_bytes,
    format_table,
    predict,
    predict_table,
    recommend,
)
from dspzoo.core.parallel.methods.megatron import parallelize_megatron
from dspzoo.core.parallel.trace import SavedTensorMeter
from dspzoo.core.testing import run_distributed, sub_mesh
from dspzoo.domains.text.workload import text_workload
from dspzoo.domains.video.workload import video_workload
from dspzoo.zoo import create_model, get_config
from dspzoo.zoo.workloads import workload_for

VIDEO = {"hidden": 32, "heads": 4, "depth": 2, "full_attention_every": 2, "num_classes": 3}
TEXT = {"hidden": 24, "heads": 4, "depth": 2}
STRATEGIES = ("dsp", "ulysses", "ring", "ring_zigzag", "lss", "usp", "megatron_sp")
TEXT_STRATEGIES = ("dsp", "ulysses", "ring", "ring_zigzag", "lss", "usp")  # no TP hooks in ByteLM
OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p")


# -- the models and their workloads ------------------------------------------------------------
def _video_model(dtype=torch.float64, cond: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("stdit-tiny", cond_dim=16 if cond else 0, **VIDEO).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _video_inputs(dtype=torch.float64, cond: bool = True) -> dict:
    g = torch.Generator().manual_seed(1)
    out = {
        "x": torch.randn(2, 12, 5, 6, 6, generator=g, dtype=dtype),
        "timestep": torch.rand(2, generator=g, dtype=dtype) * 1000,
        "y": torch.tensor([0, 2]),
    }
    if cond:
        out["cond"] = torch.randn(2, 7, 16, generator=g, dtype=dtype)
    return out


def _video_workload(itemsize: int = 8, cond: bool = True):
    config = dataclasses.replace(get_config("stdit-tiny"), cond_dim=16 if cond else 0, **VIDEO)
    return video_workload(
        "stdit-tiny",
        config,
        frames=5,
        spatial=6,
        batch=2,
        context=7 if cond else 0,
        itemsize=itemsize,
    )


def _text_model(kv_heads=None, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("bytelm-tiny", kv_heads=kv_heads, **TEXT).to(dtype)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))


def _text_workload(kv_heads=None, itemsize: int = 8):
    config = dataclasses.replace(get_config("bytelm-tiny"), kv_heads=kv_heads, **TEXT)
    return text_workload("bytelm-tiny", config, seq_len=11, batch=2, itemsize=itemsize)


def _video_step(sp, dtype=torch.float64, strategy=None):
    model = _video_model(dtype)
    if strategy == "megatron_sp":
        parallelize_megatron(model, sp.group)
    inputs = _video_inputs(dtype)
    out = model(**inputs, sp=sp)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=dtype)
    ((out - weight) ** 2).mean().backward()
    return out.detach()


def _text_step(sp, kv_heads=None, dtype=torch.float64):
    model = _text_model(kv_heads, dtype)
    out = model(_tokens(), sp=sp)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    (out * weight).sum().backward()
    return out.detach()


def _traced(tracer) -> dict:
    return {
        (op, phase): [tracer.count(op, phase), tracer.total_bytes(op, phase)]
        for op in OPS
        for phase in ("forward", "backward")
    }


def _formula(counts) -> dict:
    return {
        (op, phase): list(counts[(op, phase)]) for op in OPS for phase in ("forward", "backward")
    }


def _worker(rank: int, world: int) -> dict:
    meshes = {2: sub_mesh(2), 3: sub_mesh(3)}
    results: dict = {"bytes": {}, "memory": {}, "auto": {}}
    video_ref = _video_step(SeqParallel())
    text_ref = {kv: _text_step(SeqParallel(), kv) for kv in (None, 1)}
    for size, mesh in meshes.items():
        if mesh is None:
            continue
        r = mesh.sp_rank
        for strategy in STRATEGIES:
            sp = SeqParallel(mesh, strategy)
            with trace_comm() as tracer:
                _video_step(sp, strategy=strategy)
            want = comm_bytes(_video_workload(), strategy, size, r)
            results["bytes"][("video", strategy, size, r)] = (_traced(tracer), _formula(want))
        for strategy in TEXT_STRATEGIES:
            for kv in (None, 1):
                sp = SeqParallel(mesh, strategy)
                with trace_comm() as tracer:
                    _text_step(sp, kv)
                want = comm_bytes(_text_workload(kv), strategy, size, r)
                key = ("text", f"{strategy} kv={kv}", size, r)
                results["bytes"][key] = (_traced(tracer), _formula(want))
        # strategy="auto": the cost model's plan, exact against one process
        sp = SeqParallel(mesh, "auto")
        out = _video_step(sp)
        torch.testing.assert_close(out, video_ref, rtol=1e-7, atol=1e-9)
        plan = sp.plan(("t", "s"), (5, 9), _video_model().STAGES)
        results["auto"][("video", size)] = plan.methods
        for kv in (None, 1):
            sp = SeqParallel(mesh, "auto")
            torch.testing.assert_close(_text_step(sp, kv), text_ref[kv], rtol=1e-7, atol=1e-9)
            results["auto"][(f"text kv={kv}", size)] = sp.plan(
                ("l",), (11,), _text_model(kv).stages
            ).methods
        if size == 2:
            for strategy in ("dsp", "ulysses", "ring", "lss", "megatron_sp"):
                results["memory"][("video", strategy, r)] = _video_memory(mesh, strategy)
            for strategy in ("dsp", "ulysses", "ring", "lss"):
                results["memory"][("text", strategy, r)] = _text_memory(mesh, strategy)
    return results


def _video_memory(mesh, strategy) -> int:
    sp = SeqParallel(mesh, strategy)
    model = _video_model(torch.float32)
    if strategy == "megatron_sp":
        parallelize_megatron(model, None if mesh is None else mesh.sp_group)
    with SavedTensorMeter(model.parameters()) as meter:
        model(**_video_inputs(torch.float32), sp=sp)
    return meter.bytes


def _text_memory(mesh, strategy) -> int:
    sp = SeqParallel(mesh, strategy)
    model = _text_model(None, torch.float32)
    with SavedTensorMeter(model.parameters()) as meter:
        model(_tokens(), sp=sp)
    return meter.bytes


@pytest.fixture(scope="module")
def distributed() -> list[dict]:
    return run_distributed(_worker, 3, timeout=280)


# -- exact bytes -------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_formulas_equal_the_tracer_for_every_strategy(distributed) -> None:
    checked = 0
    for results in distributed:
        for key, (traced, formula) in results["bytes"].items():
            assert traced == formula, (
                key,
                {k: (traced[k], formula[k]) for k in traced if traced[k] != formula[k]},
            )
            checked += 1
    # video: 7 strategies × (2 + 3 ranks); text: 6 × 2 KV settings × 5 ranks
    assert checked == 7 * 5 + 12 * 5


# -- memory ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_activation_memory_within_10_percent_at_sp_1_and_2(distributed) -> None:
    video, text = _video_workload(4), _text_workload(None, 4)
    measured = {
        ("video", "none", 0): _video_memory(None, "dsp"),
        ("text", "none", 0): _text_memory(None, "dsp"),
    }
    predicted = {
        ("video", "none", 0): activation_bytes(video),
        ("text", "none", 0): activation_bytes(text),
    }
    for results in distributed[:2]:
        for (family, strategy, r), got in results["memory"].items():
            measured[(family, strategy, r)] = got
            wl = video if family == "video" else text
            predicted[(family, strategy, r)] = activation_bytes(wl, strategy, 2, r)
    assert len(measured) == 2 + 2 * (5 + 4)
    for key, got in measured.items():
        assert abs(predicted[key] / got - 1) <= 0.10, (key, got, predicted[key])


# -- strategy="auto" ---------------------------------------------------------------------------
def test_auto_picks_what_the_cost_model_says(distributed) -> None:
    video, text = _video_workload(), _text_workload()
    for size in (2, 3):
        plan = auto_plan(video.dims, video.lengths, video.period, size)
        assert distributed[0]["auto"][("video", size)] == plan.methods
        # axial layers: DSP's switches (2 units) beat any embedded method (>= 8 units)
        assert plan.methods["spatial@0"] == plan.methods["temporal@0"] == "local"
        assert plan.methods["full@1"] == "ulysses"  # 4 heads >= N: Ulysses' 8 units < LSS' 4N
        for kv in (None, 1):
            got = distributed[0]["auto"][(f"text kv={kv}", size)]
            assert got == auto_plan(text.dims, text.lengths, text.period, size).methods
    # heads < N: Ulysses would idle ranks; under the causal mask the balanced ring (3(N+1)) is
    # cheaper than LSS (4N) and Ring (6N); without it LSS is
    assert text.period[0].causal
    assert auto_plan(("l",), (64,), text.period, 8).methods["attn"] == "ring_balanced"
    acausal = tuple(dataclasses.replace(s, causal=False) for s in text.period)
    assert auto_plan(("l",), (64,), acausal, 8).methods["attn"] == "lss"
    # a causal stage never gets a method that leaves its causal work unbalanced: at N = 2 LSS'
    # 4N = 8 units are the fewest, but its last rank would do 1.5× the mean; the balanced ring
    # ties the balanced LSS (9) and comes first
    one_head = tuple(dataclasses.replace(s, heads=1) for s in text.period)
    assert auto_plan(("l",), (64,), one_head, 2).methods["attn"] == "ring_balanced"
    one_head_acausal = tuple(dataclasses.replace(s, causal=False) for s in one_head)
    assert auto_plan(("l",), (64,), one_head_acausal, 2).methods["attn"] == "lss"
    # the auto plan's bytes are the least of the candidates the rule compares
    for size in (2, 3):
        auto = comm_bytes(video, auto_plan(video.dims, video.lengths, video.period, size), size)
        for strategy in ("ulysses", "ring", "lss"):
            assert auto.bytes() <= comm_bytes(video, strategy, size).bytes()


# -- predictions -------------------------------------------------------------------------------
def test_prediction_table_and_recommendation() -> None:
    wl = workload_for("stdit-720M", frames=128, spatial=128, batch=1, itemsize=2)
    strategies = ("dsp", "ulysses", "ulysses_flat", "megatron_sp")
    rows = predict_table(wl, strategies, (1, 2, 4, 8), recompute=True)
    by = {(p.strategy, p.sp): p for p in rows}
    for n in (2, 4, 8):  # same FLOPs, DSP sends least: fastest
        assert by[("dsp", n)].flops == by[("ulysses", n)].flops
        assert by[("dsp", n)].bytes < by[("ulysses", n)].bytes < by[("ulysses_flat", n)].bytes
        assert by[("dsp", n)].step_s < by[("ulysses", n)].step_s
    # Table 3's counts: Ulysses 4 activation all-to-alls per axial layer against DSP's 2
    # (≥ 50 % less), the flattened layout 8 (≥ 75 % less)
    assert by[("ulysses", 8)].bytes / by[("dsp", 8)].bytes == pytest.approx(2, rel=0.05)
    assert by[("ulysses_flat", 8)].bytes / by[("dsp", 8)].bytes == pytest.approx(4, rel=0.05)
    best = recommend(rows)
    assert best is not None and best.strategy in ("dsp", "none")
    assert all(not p.fits for p in rows if p.sp < best.sp)
    text = format_table(rows, best)
    assert "recommended" in text and "ulysses_flat" in text
    assert set(CLUSTERS) >= {
        "h100-nvlink-ib",
        "h800-nvlink-ib",
        "a100-nvlink-ib",
        "v100-summit",
        "this-cpu",
    }
    # forward-only (inference) is cheaper than a training step
    assert predict(wl, "dsp", 4, training=False).step_s < predict(wl, "dsp", 4).step_s


def test_plan_cli_prints_the_table(capsys) -> None:
    from dspzoo.zoo.plan_cli import main

    assert (
        main(
            [
                "stdit-720M",
                "--frames",
                "64",
                "--size",
                "256",
                "--sp",
                "1,2,4",
                "--cluster",
                "a100-nvlink-ib",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommendation" in out and "dsp" in out
    assert (
        main(
            [
                "bytelm-lss-12l",
                "--seq-len",
                "8192",
                "--sp",
                "2,4",
                "--strategies",
                "lss,megatron_sp",
            ]
        )
        == 0
    )
    assert "lss" in capsys.readouterr().out


# -- the published figures and the added terms ----------------------------------------------------
# figures the doc states are reproduced within ±25 % (the others it states are not)
REACHED = {
    "OpenSora 1 GPU, 100 steps",
    "DSP paper: DSP/Ulysses(4), low end",
    "DSP paper: DSP/Ulysses(8), low end",
    "DSP paper: DSP/Ulysses(8), high end",
}


def test_published_workloads_have_the_papers_token_counts() -> None:
    """The published experiments' tokens: OpenSora 512² px = 80 × 1024 (a 64² latent), the DSP
    paper's 1024² px = T × 4096 (a 128² latent; the grid once had a quarter of that)."""
    from dspzoo.core.costmodel import validation

    opensora = validation._workload(
        "stdit-720M",
        frames=80,
        spatial=validation.OPENSORA_LATENT,
        batch=2,
        context=120,
        itemsize=2,
    )
    assert opensora.lengths == (80, 1024)
    for model, n in validation.DSP_GRID:
        wl = validation._workload(
            model, frames=n, spatial=validation.DSP_LATENT, batch=1, context=120, itemsize=2
        )
        assert wl.lengths == (n, 4096), (model, n, wl.lengths)


def test_published_figures_are_the_docs_table() -> None:
    """docs/cost_model.md's table is this code's output, and its claims hold both ways."""
    from pathlib import Path

    from dspzoo.core.costmodel.validation import format_validation, validation_table

    rows = validation_table()
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cost_model.md").read_text()
    assert format_validation(rows) in doc  # every published / before / after / residual
    assert {r.figure.name for r in rows} >= REACHED
    for r in rows:
        assert (abs(r.residual) <= 0.25) == (r.figure.name in REACHED), (
            r.figure.name,
            r.residual,
        )
    # the model before the terms: the figures the doc listed for it (OpenSora, seconds)
    before = {r.figure.name: r.before for r in rows}
    assert before["OpenSora 1 GPU, 100 steps"] == pytest.approx(62.0, abs=0.05)
    # 13.7 s before the flattened Ulysses counted its exit all-gather (as the reference code sends)
    assert before["OpenSora 8 GPU Ulysses (8 a2a/layer)"] == pytest.approx(13.75, abs=0.05)
    assert before["OpenSora 8 GPU DSP"] == pytest.approx(9.2, abs=0.05)


def test_nccl_latency_model() -> None:
    from dspzoo.core.costmodel import get_cluster
    from dspzoo.core.costmodel.validation import plain_alpha_beta

    h100 = get_cluster("h100-nvlink-ib")  # 8 GPUs per node
    us = 1e-6
    assert h100.collective_latency("all_gather", 1) == 0.0
    assert h100.collective_latency("all_gather", 8) == pytest.approx((8.4 + 7 * 3.4) * us)
    # 16 ranks on 2 nodes: 14 steps inside the nodes, 1 across
    assert h100.collective_latency("reduce_scatter", 16) == pytest.approx(
        (8.4 + 14 * 3.4 + 14.0) * us
    )
    assert h100.collective_latency("all_to_all", 8) == pytest.approx((8.4 + 3.4) * us)
    assert h100.collective_latency("all_to_all", 16) == pytest.approx((8.4 + 14.0) * us)
    plain = plain_alpha_beta(h100)
    assert plain.collective_latency("all_gather", 8) == h100.intra_lat
    assert plain.collective_latency("all_gather", 16) == h100.inter_lat


def test_memory_bound_terms_and_their_sum() -> None:
    from dspzoo.core.costmodel import get_cluster
    from dspzoo.core.costmodel.formulas import (
        elementwise_bytes,
        layout_copy_bytes,
        unfused_score_bytes,
    )
    from dspzoo.core.costmodel.validation import plain_alpha_beta

    wl = workload_for("stdit-720M", frames=16, spatial=64, batch=1, itemsize=2)
    act = activation_bytes(wl, "dsp", 4)
    assert elementwise_bytes(wl, "dsp", 4, training=False) == 2 * act
    assert elementwise_bytes(wl, "dsp", 4) == 6 * act
    assert elementwise_bytes(wl, "dsp", 4, recompute=True) == 8 * act
    assert layout_copy_bytes(300.0, 4) == pytest.approx(4 * 300 * 4 / 3)
    assert layout_copy_bytes(300.0, 1) == 0.0
    assert unfused_score_bytes(wl, 4) == pytest.approx(
        3 * unfused_score_bytes(wl, 4, training=False)
    )
    h100 = get_cluster("h100-nvlink-ib")
    for strategy in ("dsp", "ulysses", "ulysses_flat"):
        p = predict(wl, strategy, 4, h100, exact_ranks=False)
        assert p.memory_s == pytest.approx(elementwise_bytes(wl, "dsp", 4) / h100.hbm_bw)
        assert p.copy_s > 0 and p.latency_s > 0
        assert p.step_s == pytest.approx(p.compute_s + p.memory_s + p.copy_s + p.comm_s)
        old = predict(wl, strategy, 4, plain_alpha_beta(h100), exact_ranks=False)
        assert old.memory_s == old.copy_s == 0.0
        assert old.step_s == pytest.approx(old.compute_s + old.comm_s)
        assert old.comm_s == pytest.approx(
            old.bytes / h100.intra_bw + old.collectives * h100.intra_lat
        )
    # the flattened Ulysses sends 4× DSP's bytes: 4× its copies
    flat = predict(wl, "ulysses_flat", 4, h100, exact_ranks=False)
    dsp = predict(wl, "dsp", 4, h100, exact_ranks=False)
    assert flat.copy_s / dsp.copy_s == pytest.approx(flat.bytes / dsp.bytes, rel=0.02)
    # Volta has no fused attention: its score traffic is in the memory term
    v100 = get_cluster("v100-summit")
    text = workload_for("bytelm-lss-12l", seq_len=4096, batch=1, itemsize=2)
    p = predict(text, "lss", 8, v100, exact_ranks=False)
    want = elementwise_bytes(text, "lss", 8) + unfused_score_bytes(text, 8)
    assert p.memory_s == pytest.approx(want / v100.hbm_bw)


def test_micro_batching_pays_latency_per_micro_batch() -> None:
    from dspzoo.core.costmodel.predict import micro_batches

    assert micro_batches(10.0, 1.0, 20.0, 4) == 1  # fits
    assert micro_batches(30.0, 1.0, 20.0, 4) == 2
    assert micro_batches(30.0, 1.0, 20.0, 3) == 3
    assert micro_batches(300.0, 1.0, 20.0, 4) == 1  # no split fits: left to `fits`
    wl = workload_for("stdit-3B", frames=64, spatial=64, batch=4, itemsize=2)
    plain = predict(wl, "dsp", 8, exact_ranks=False)
    assert not plain.fits
    micro = predict(wl, "dsp", 8, exact_ranks=False, micro_batching=True)
    m = int(micro.note.split()[0])
    assert micro.fits and m == 4 and "micro-batches" in micro.note  # 2 do not fit
    assert micro.activation == pytest.approx(plain.activation / m)
    assert micro.latency_s == pytest.approx(plain.latency_s * m)
    assert micro.bytes == plain.bytes and micro.flops == plain.flops
    assert micro.step_s == pytest.approx(plain.step_s + (m - 1) * plain.latency_s)


def test_bench_auto_column() -> None:
    """The benchmark's auto column: the row running auto's plan, its time over the best."""
    from dspzoo.core.bench.auto_choice import auto_choice, auto_line, needs_own_row, twins
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.runner import build_parser

    args = build_parser().parse_args(["--model", "stdit-tiny", "--frames", "4", "--latent", "8"])
    case = build_case(args, 1)
    names = ["dsp", "ulysses", "ring"]
    assert twins(case, names, 2, 1) == ["dsp"]  # axial layers: auto runs DSP's switches
    assert not needs_own_row(case, names, 2, 1)
    assert needs_own_row(case, ["ulysses", "ring"], 2, 1)

    def row(name, times):
        return {"strategy": name, "times": times, "time": {"median": sorted(times)[1]}}

    result = {
        "sp": 2,
        "dp": 1,
        "rows": [
            row("dsp", [1.2, 1.0, 1.1]),
            row("ulysses", [1.0, 0.9, 1.0]),
            row("ring", [2.0] * 3),
        ],
    }
    choice = auto_choice(result, case)
    assert choice["runs_as"] == ["dsp"] and choice["best"] == "ulysses"
    assert choice["vs_best"] == pytest.approx(1.1 / 1.0)
    # per round: 1.2/1.0, 1.0/0.9, 1.1/1.0 -> median 1.0/0.9
    assert choice["vs_best_paired"]["median"] == pytest.approx(1.0 / 0.9)
    assert "auto / best = 1.10" in auto_line(choice)
    assert auto_choice({**result, "sp": 1}, case) is None
    # plans against plans: two rows running auto's plan pool their repetitions, and the best
    # plan is timed the same way — a fast twin makes auto's plan the best, whatever the other
    # twin's luck (the first version set the pooled twins against the fastest single row)
    twins_result = {
        "sp": 2,
        "dp": 1,
        "rows": [
            row("dsp", [0.5, 0.6, 0.7]),
            row("ulysses", [0.8, 0.9, 1.0]),
            row("ring", [0.7, 0.8, 0.9]),
        ],
    }
    video = auto_choice(twins_result, case)  # axial video: dsp's plan is its own
    assert video["best"] == "dsp" and video["vs_best"] == 1.0
    text_args = build_parser().parse_args(["--model", "bytelm-tiny", "--seq-len", "64"])
    text = build_case(text_args, 1)
    assert twins(text, names, 2, 1) == ["dsp", "ulysses"]  # 1-D: DSP's plan is Ulysses
    choice = auto_choice(twins_result, text)
    # dsp + ulysses pooled: median of 0.5…1.0 = 0.75 against ring's 0.8
    assert choice["runs_as"] == ["dsp", "ulysses"] and choice["best"] == "dsp, ulysses"
    assert choice["vs_best"] == 1.0 and choice["vs_best_paired"]["median"] == 1.0
    slow = {**twins_result, "rows": [*twins_result["rows"][:2], row("ring", [0.5, 0.55, 0.6])]}
    lost = auto_choice(slow, text)
    assert lost["best"] == "ring" and lost["vs_best"] == pytest.approx(0.75 / 0.55)


@pytest.mark.parametrize("strategy", ["dsp", "ulysses", "lss", "ring"])
def test_recomputation_sends_the_forwards_collectives_again(strategy: str) -> None:
    """Activation checkpointing reruns each block's forward, communication included: the
    prediction adds the forward's bytes and collectives once."""
    wl = text_workload("bytelm-tiny", get_config("bytelm-tiny"), batch=2, seq_len=64)
    counts = comm_bytes(wl, strategy, 2, 0, exit_gather=False)  # training: the loss on the shard
    plain = predict(wl, strategy, 2, "h100-nvlink-ib", exact_ranks=False)
    again = predict(wl, strategy, 2, "h100-nvlink-ib", recompute=True, exact_ranks=False)
    forward = counts.bytes(phase="forward")
    assert forward > 0
    assert again.bytes == plain.bytes + forward
    forward_calls = counts.count(phase="forward")
    assert again.collectives == plain.collectives + forward_calls
    assert again.comm_s > plain.comm_s


@pytest.mark.parametrize("strategy", ["dsp", "ulysses", "ring", "lss"])
@pytest.mark.parametrize("name", ["weathertx-tiny", "weathermamba-tiny"])
def test_recomputation_does_not_resend_the_exit_gather(name: str, strategy: str) -> None:
    """A model whose training step gathers its output at the exit (the weather models' loss
    needs the whole forecast): checkpointing reruns the blocks' collectives, not the exit
    all-gather, which is counted once."""
    import dspzoo.domains.mamba  # noqa: F401  (registers the weather families)
    import dspzoo.domains.weather  # noqa: F401
    from dspzoo.core.costmodel.formulas import exit_gather_bytes, make_plan

    wl = workload_for(name)
    assert not wl.loss_on_shard
    counts = comm_bytes(wl, strategy, 3, 0)  # the exit gather included, as training sends it
    exit_bytes = exit_gather_bytes(wl, make_plan(wl, strategy, 3), 3)
    assert exit_bytes > 0
    assert counts.bytes() - comm_bytes(wl, strategy, 3, 0, exit_gather=False).bytes() == exit_bytes
    plain = predict(wl, strategy, 3, "h100-nvlink-ib", exact_ranks=False)
    again = predict(wl, strategy, 3, "h100-nvlink-ib", recompute=True, exact_ranks=False)
    assert plain.bytes == counts.bytes()  # the step's exit gather is counted ...
    blocks = counts.bytes(phase="forward") - exit_bytes
    assert blocks > 0
    assert again.bytes == plain.bytes + blocks  # ... and not rerun
    calls = counts.count(phase="forward") - 1
    assert again.collectives == plain.collectives + calls


@pytest.mark.timeout(120)
def test_this_cpu_probe_measures_caches_and_reads_back(tmp_path, monkeypatch) -> None:
    """``measure_this_cpu`` probes a 2-process gloo group (per-call medians), caches the
    figures atomically with their time, and reads the cache back as the same cluster."""
    from dspzoo.core.costmodel import measure_this_cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probed = measure_this_cpu(refresh=True)
    assert probed.name == "this-cpu" and probed.mfu == 1.0
    assert probed.flops > 1e8 and probed.intra_bw > 1e6 and 0 < probed.intra_lat < 1.0
    assert probed.hbm_bw > 1e8  # the streaming copy: the memory-bound terms are on
    assert probed.switch_bw > 1e6 and 0 < probed.switch_lat < 1.0  # a real switch, timed
    # every collective of the library takes the switch's transport on this host
    assert (probed.intra_bw, probed.intra_lat) == (probed.switch_bw, probed.switch_lat)
    path = tmp_path / "dspzoo" / "this-cpu.json"
    record = json.loads(path.read_text())
    assert record["measured_at"] > 0 and record["probe"] == {"ranks": 2, "threads": 1}
    assert not list(path.parent.glob("*.tmp"))
    assert measure_this_cpu() == probed
    from dspzoo.core.costmodel.cluster import this_cpu_note

    assert "on 2 ranks × 1 thread(s)" in this_cpu_note()


def test_a_bench_at_sp_1_predicts_on_the_cached_cluster(tmp_path, monkeypatch) -> None:
    """SP 1 has no collective to probe: the prediction uses the cached ``this-cpu`` (the
    in-run probe once made every SP 1 row a ZeroDivisionError), and ``probe_group`` outside a
    group of 2 or more refuses with the way out."""
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.runner import add_prediction, build_parser
    from dspzoo.core.costmodel.cluster import PRESETS, cache_this_cpu
    from dspzoo.core.costmodel.probe import Rates, probe_group

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = PRESETS["h100-nvlink-ib"].with_(name="this-cpu")
    cache_this_cpu(cached, Rates(1e12, 1e9, 1e-4, 2))
    case = build_case(build_parser().parse_args(["--model", "bytelm-tiny", "--seq-len", "64"]), 1)
    time = {"median": 0.5}
    result = {"sp": 1, "dp": 1, "rows": [{"strategy": "dsp", "time": time, "times": [0.5]}]}
    add_prediction(result, case, "this-cpu")
    assert result["rows"][0]["prediction"]["step_s"] > 0
    # the cached cluster has a memory bandwidth: the error is also given without those terms
    prediction = result["rows"][0]["prediction"]
    assert prediction["memory_s"] > 0
    assert prediction["error_without_probed_terms"] < prediction["error"]
    assert "median_abs_without_probed_terms" in result["prediction_error"]
    assert result["cluster"]["peak_tflops"] == cached.peak_tflops
    with pytest.raises(ValueError, match="group of 2 or more"):
        probe_group()


def test_a_measured_attention_rate_prices_the_attention_share() -> None:
    """Where the attention kernels were measured apart (``this-cpu``), the attention's share
    of the FLOPs runs at that rate, the rest at the matmul rate; the presets are unchanged."""
    from dspzoo.core.costmodel.cluster import PRESETS
    from dspzoo.core.costmodel.formulas import forward_flops
    from dspzoo.core.costmodel.probe import AttentionShape, attention_rate

    wl = workload_for("stdit-720M", frames=16, spatial=64, batch=1, itemsize=2)
    h100 = PRESETS["h100-nvlink-ib"]
    assert h100.attention_tflops == 0 and h100.attention_flops == h100.flops
    plain = predict(wl, "dsp", 4, h100)
    half = predict(wl, "dsp", 4, h100.with_(attention_tflops=h100.flops / 2e12))
    parts = forward_flops(wl)
    share = parts.attention / parts.forward
    assert 0 < share < 1
    assert half.compute_s == pytest.approx(plain.compute_s * (1 + share))
    # the probe's rate: SDPA forward + backward at the given shape, in FLOP/s
    assert attention_rate(AttentionShape(2, 2, 64, 16), seconds=0.05) > 1e7


def test_a_probed_switch_rate_prices_the_switches_bytes_and_their_layout_work() -> None:
    """Where switches take their own transport (``this-cpu``: shared memory), their
    all-to-all bytes and calls run at the probed switch rate and latency, which include the
    layout work (no separate copy term); other collectives keep the all-to-all's α-β."""
    from dspzoo.core.costmodel.cluster import PRESETS
    from dspzoo.core.costmodel.formulas import comm_bytes

    wl = workload_for("stdit-720M", frames=16, spatial=64, batch=1, itemsize=2)
    h100 = PRESETS["h100-nvlink-ib"]
    assert h100.switch_bw == 0 and h100.switch_lat == 0  # presets: unchanged
    plain = predict(wl, "dsp", 4, h100)
    fast = h100.with_(switch_bw=h100.intra_bw * 4, switch_lat=h100.intra_lat / 2)
    quick = predict(wl, "dsp", 4, fast)
    assert plain.copy_s > 0 and quick.copy_s == 0
    a2a = comm_bytes(wl, "dsp", 4, 0).bytes(op="all_to_all")
    assert a2a > 0
    other = plain.bytes - a2a
    assert quick.comm_s - quick.latency_s == pytest.approx(
        h100.transfer_time(other, 4) + a2a / fast.switch_bw
    )
    assert fast.collective_latency("all_to_all", 4) == fast.switch_lat
    assert fast.collective_latency("all_gather", 4) == h100.collective_latency("all_gather", 4)
    # Megatron-SP sends no all-to-all: the switch rate leaves it as it was
    assert predict(wl, "megatron_sp", 4, fast).step_s == predict(wl, "megatron_sp", 4, h100).step_s


def test_contiguous_causal_lss_is_priced_unbalanced_like_ring() -> None:
    """Causal LSS on its contiguous layout: the last rank's attention is ``(2N − 1)/N`` of the
    average (the zigzag layout balances it); without a causal mask both cost the same."""
    from dspzoo.core.costmodel.cluster import PRESETS
    from dspzoo.core.costmodel.formulas import forward_flops

    wl = workload_for("bytelm-lss-12l", seq_len=4096, batch=1, itemsize=2)
    h100, n = PRESETS["h100-nvlink-ib"], 4
    assert wl.causal
    parts = forward_flops(wl)
    share = parts.attention / parts.forward
    lss, zigzag = predict(wl, "lss", n, h100), predict(wl, "lss_zigzag", n, h100)
    assert lss.compute_s == pytest.approx(zigzag.compute_s * (1 + share * ((2 * n - 1) / n - 1)))
    # not causal: the workload, and each stage (a stage's own flag outranks its planner stage's)
    layers = tuple(tuple(dataclasses.replace(s, causal=False) for s in x) for x in wl.layers)
    plain = wl.with_(causal=False, layers=layers)
    assert (
        predict(plain, "lss", n, h100).compute_s == predict(plain, "lss_zigzag", n, h100).compute_s
    )


def test_causal_imbalance_follows_the_plans_methods_not_the_strategys_name() -> None:
    """DSP's plan for a causal 1-D model with fewer heads than ranks runs ``ring_balanced``
    (the cheapest hybrid method under a causal mask), so it is priced balanced, as
    ``ring_zigzag``, and the contiguous ``ring`` with its imbalance; a plan that ran ``ring``
    would be priced as ring (the methods decide, not the strategy's name). USP's imbalance is
    its ring's over the ``R = N/U`` slots, ``(2R − 1)/R``, not ``(2N − 1)/N``."""
    from dspzoo.core.costmodel.cluster import PRESETS
    from dspzoo.core.costmodel.formulas import forward_flops, make_plan

    wl = workload_for("bytelm-lss-12l", seq_len=4096, batch=1, itemsize=2)  # 8 heads
    h100, n = PRESETS["h100-nvlink-ib"], 16
    dsp, ring = predict(wl, "dsp", n, h100), predict(wl, "ring", n, h100)
    zigzag = predict(wl, "ring_zigzag", n, h100)
    balanced = predict(wl, "ring_balanced", n, h100)
    assert make_plan(wl, "dsp", n).steps[0].method == "ring_balanced"
    assert (dsp.flops, dsp.compute_s) == (balanced.flops, balanced.compute_s)
    assert dsp.flops == zigzag.flops < ring.flops
    parts = forward_flops(wl)
    share = parts.attention / parts.forward
    u = 4  # the default grid at N = 16: Ulysses 4 × ring 4
    usp = predict(wl, "usp", n, h100, ulysses_size=u)
    r = n // u
    assert usp.flops == pytest.approx(zigzag.flops * (1 + share * ((2 * r - 1) / r - 1)))


def test_the_causal_imbalance_is_charged_to_the_causal_stage_that_runs_the_method() -> None:
    """axial3d attends causally along time only. Ring on ``h`` (a short time dim) leaves the
    causal time stage local: ring, ring_balanced and ring_zigzag are priced alike. Ring on
    ``t`` runs the causal stage unbalanced: it is priced above the balanced two, which agree."""
    from dspzoo.core.costmodel.cluster import PRESETS
    from dspzoo.core.costmodel.formulas import make_plan

    h100, names = PRESETS["h100-nvlink-ib"], ("ring", "ring_balanced", "ring_zigzag")
    short = workload_for("axial3d-mini", frames=4, spatial=(32, 32))  # t = 4: ring shards h
    assert make_plan(short, "ring", 4).methods["time"] == "local"
    assert len({predict(short, s, 4, h100).flops for s in names}) == 1
    long = workload_for("axial3d-mini", frames=64, spatial=(32, 32))
    ring, balanced, zigzag = (predict(long, s, 4, h100).flops for s in names)
    assert make_plan(long, "ring", 4).methods["time"] == "ring"
    assert balanced == zigzag < ring
    lss, lss_balanced, lss_zigzag = (
        predict(long, s, 4, h100).flops for s in ("lss", "lss_balanced", "lss_zigzag")
    )
    assert lss_balanced == lss_zigzag < lss

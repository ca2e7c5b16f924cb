"""The benchmark (``scripts/benchmark.py``), the one measuring tool.

Two 2-process launches: a tiny timed run (every strategy, 2 interleaved repetitions, its
outputs and files) and, on an uneven hybrid shape, the traced step only (``--reps 0``): per
strategy at SP 2 the traced bytes equal the cost model's formula on every rank for every op
and phase, and the output and every gradient agree with one process. The byte formulas the
bench compares against (the method registry's, walked by ``comm_bytes``) are checked against
the textbook even-case values and the uneven-shard bookkeeping without a launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspzoo.core.bench import (
    MeshCache,
    build_case,
    build_parser,
    not_runnable,
    select_strategies,
)
from dspzoo.core.bench.case import Case
from dspzoo.core.bench.peer import deepspeed_cannot_run
from dspzoo.core.bench.stats import moved_beyond_iqr, paired_ratios, spread
from dspzoo.core.costmodel import comm_bytes
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.methods.registry import (
    AttentionShape,
    CommCount,
    get_method,
    megatron_pair_bytes,
    switch_bytes,
)
from dspzoo.core.parallel.strategies import STRATEGIES
from dspzoo.zoo.workloads import workload_for

REPO = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, *flags: str, timeout: float = 150, cluster: str = "none") -> dict:
    """One 2-process launch of scripts/benchmark.py; its results.json (the cache, where the
    ``this-cpu`` probe lands, under ``tmp_path``)."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "scripts" / "benchmark.py"),
        "--peer", "off", "--cluster", cluster, "--no-progress", "--out", str(out), *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reproduce: `accelerate launch" in proc.stdout
    result = json.loads((out / "results.json").read_text())
    result["_out"] = out
    return result


def _assert_exact_and_agrees(rows: dict) -> None:
    for name, r in rows.items():
        assert r["formula_exact"], (name, r["bytes_by_op"], r["formula_bytes_by_op"])
        assert r["agrees"], (name, r["output_error"], r["grad_error"], r["worst_param"])
        assert r["output_error"] < 1e-4 and r["grad_error"] < 1e-4, name
        assert r["activation_bytes"] > 0


# -- launches ---------------------------------------------------------------------------------
@pytest.mark.timeout(170)
def test_benchmark_runs_end_to_end_on_a_tiny_case(tmp_path: Path) -> None:
    result = _launch(tmp_path, "--model", "stdit-tiny", "--frames", "4", "--latent", "8",
                     "--warmup", "1", "--reps", "2", cluster="this-cpu")  # fmt: skip
    rows = {r["strategy"]: r for r in result["rows"]}
    # the cost model predicts on the rates this run probed on its SP group (and caches them)
    probe = result["probe"]
    assert probe["ranks"] == 2 and probe["flops"] > 0 and probe["bandwidth"] > 0
    assert 0 < probe["latency"] < 1.0
    assert 0 < probe["switch_latency"] < 1.0 and probe["switch_bandwidth"] > 0
    assert result["cluster"]["intra_lat"] == probe["switch_latency"]
    assert result["cluster"]["peak_tflops"] == pytest.approx(probe["flops"] / 1e12)
    cached = json.loads((tmp_path / "cache" / "dspzoo" / "this-cpu.json").read_text())
    assert cached["intra_bw"] == probe["switch_bandwidth"] and cached["measured_at"] > 0
    assert all(r["prediction"]["step_s"] > 0 for r in rows.values())
    assert "probed in this run" in (result["_out"] / "results.md").read_text()
    # the one strategy list: every registered strategy ran, dsp first
    assert list(rows) == ["dsp", *[s for s in STRATEGIES if s != "dsp"]]
    assert result["skipped"]["deepspeed_ulysses"] == "--peer off"
    # one mesh per layout: the world's (SP 1), the plain SP 2 one, USP's ring × ulysses one
    assert result["meshes"] == 3
    _assert_exact_and_agrees(rows)
    for name, r in rows.items():
        assert len(r["times"]) == 2 and r["time"]["min"] <= r["time"]["median"]
        paired = r["vs_dsp"]["time_paired"]
        assert paired["q1"] <= paired["median"] <= paired["q3"], name
    assert rows["dsp"]["vs_dsp"]["time_paired"]["median"] == 1.0
    # DSP moves the fewest bytes of all (the paper's claim, exact on any machine)
    assert all(r["vs_dsp"]["bytes"] >= 1 for r in rows.values())
    out = result["_out"]
    assert (out / "results.png").stat().st_size > 1000
    text = (out / "results.md").read_text()
    assert "| dsp |" in text and "paired IQR" in text and "vs 1 process" in text


@pytest.mark.timeout(170)
def test_traced_bytes_equal_the_formula_and_agree_with_one_process_on_an_uneven_shape(
    tmp_path: Path,
) -> None:
    # t = 5, s = 9 over 2 ranks (uneven), every other layer a full t·s attention (hybrid DSP)
    result = _launch(tmp_path, "--model", "stdit-tiny", "--frames", "5", "--latent", "6",
                     "--full-attention-every", "2", "--reps", "0")  # fmt: skip
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == set(STRATEGIES)
    _assert_exact_and_agrees(rows)
    assert rows["dsp"]["methods"] == ["ulysses"]  # the hybrid: the full layer runs embedded
    assert all(r["times"] == [] for r in rows.values())  # --reps 0: the traced step only
    assert not (result["_out"] / "results.png").exists()


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    "flags",
    [
        ("--model", "mambalm-tiny", "--seq-len", "13"),  # Mamba-1 LM, 13 tokens: 7 + 6
        ("--model", "videomamba-tiny", "--frames", "5", "--latent", "6"),  # Mamba-2, t=5 h=w=3
    ],
    ids=["mamba-lm", "video-mamba"],
)
def test_mamba_cases_run_the_three_scan_methods_with_traced_bytes_equal_to_the_formula(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    from dspzoo.core.bench.case import SCAN_STRATEGIES

    result = _launch(tmp_path, *flags, "--reps", "1")
    rows = {r["strategy"]: r for r in result["rows"]}
    assert list(rows) == list(SCAN_STRATEGIES)  # 'all' means the scan methods for Mamba
    _assert_exact_and_agrees(rows)
    assert rows["state_passing"]["methods"] == ["state_passing"]
    assert rows["head_a2a"]["methods"] == ["head_a2a"]
    for r in rows.values():  # every method communicates inside the model at SP 2
        assert r["bytes"] > 0 and len(r["times"]) == 1


@pytest.mark.timeout(170)
def test_end_to_end_mode_takes_the_trainers_optimisation_steps(tmp_path: Path) -> None:
    """End-to-end at SP 2 (a budget nothing fits): the timed steps are the Trainer's
    optimisation steps (DDP over dp × sp; megatron_sp's tensor-parallel sync), so the loss of
    each step equals one process training the same model with AdamW on the whole batch."""
    import copy

    import torch

    from dspzoo.core.bench.runner import TRAIN_LR
    from dspzoo.core.parallel.runtime import SeqParallel

    flags = ["--model", "stdit-tiny", "--frames", "5", "--latent", "6", "--warmup", "1",
             "--reps", "3", "--mode", "end-to-end", "--memory-budget-mib", "0.001",
             "--strategies", "dsp,megatron_sp"]  # fmt: skip
    result = _launch(tmp_path, *flags)
    assert result["sp"] == 2 and "nothing fits 0.001 MiB" in result["layout"]
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"dsp", "megatron_sp"}
    _assert_exact_and_agrees(rows)
    case = build_case(build_parser().parse_args(flags), result["batch"])
    model, sp = copy.deepcopy(case.model), SeqParallel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    expected = []
    for _ in range(3):
        loss, _ = case.step(model, sp, case.inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert expected[-1] != pytest.approx(expected[0], rel=1e-5)  # the weights moved
    for name, r in rows.items():
        assert r["train_losses"] == pytest.approx(expected, rel=1e-5), name


# -- strategies a model cannot run --------------------------------------------------------------
def _case(heads: int, tp_plan: bool) -> Case:
    import torch

    class Block(torch.nn.Module):
        TP_PLAN = {"proj": "row"} if tp_plan else None

    model = torch.nn.Sequential(Block())
    model.config = SimpleNamespace(heads=heads, hidden=8, depth=1)  # type: ignore[attr-defined]
    return Case("toy", True, model, {"l": 16}, 1)


def test_a_strategy_the_model_cannot_run_is_reported_with_the_registrys_reason() -> None:
    case = _case(heads=2, tp_plan=False)
    run, skipped = select_strategies("all", case, 4)
    assert run[0] == "dsp" and "ulysses" not in run and "megatron_sp" not in run
    assert skipped["ulysses"] == "not runnable: " + get_method("ulysses").unsupported(4, 2)
    assert skipped["megatron_sp"].startswith("not runnable: Sequential declares no TP_PLAN")
    assert {"ring", "ring_zigzag", "lss", "usp"} <= set(run)
    assert "not a registered strategy" in not_runnable("ring2", case, 2)
    assert not_runnable("megatron_sp", _case(heads=4, tp_plan=True), 4) is None
    assert select_strategies("ring", case, 1)[0] == ["dsp"]  # SP 1: one row


def _refused(capsys, argv: list[str], monkeypatch) -> str:
    """``dspzoo <argv>``'s one-line error (status 2), refused before anything launches."""
    from dspzoo.core.bench import launch
    from dspzoo.zoo.cli import main

    monkeypatch.setattr(launch.subprocess, "call", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dspzoo bench: error: "), err
    return err


def test_a_misspelt_strategy_is_refused_at_parsing_before_launch(capsys, monkeypatch) -> None:
    err = _refused(capsys, ["bench", "-n", "2", "--run", "--", "--strategies", "dsp,ulyses"],
                   monkeypatch)  # fmt: skip
    assert "unknown 'ulyses'" in err and "did you mean 'ulyses' → 'ulysses'?" in err
    assert all(s in err for s in STRATEGIES)  # the valid choices
    # and inside a launched process (every rank parses the same argv: the same refusal)
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["--strategies", "dsp,ulyses"])
    assert refused.value.code == 2 and "did you mean" in capsys.readouterr().err
    assert build_parser().parse_args(["--strategies", " ring, lss "]).strategies == "ring,lss"
    # registered names the model cannot run are still listed as not runnable
    case = _case(heads=2, tp_plan=False)
    args = build_parser().parse_args(["--strategies", "ulysses,state_passing,ring"])
    run, skipped = select_strategies(args.strategies, case, 4)
    assert run == ["dsp", "ring"] and "dsp" not in skipped
    assert skipped["ulysses"].startswith("not runnable: ")
    assert skipped["state_passing"].endswith("a scan method (of Mamba models): toy has no scans")
    mamba = Case("mambalm-tiny", True, case.model, {"l": 16}, 1)
    assert select_strategies("dsp,ulysses", mamba, 2)[1]["ulysses"].startswith(
        "not runnable: a Mamba model's stages are scans"
    )


def test_a_model_the_benchmark_does_not_run_is_refused_with_the_families_it_takes(
    capsys, monkeypatch
) -> None:
    from dspzoo.core.bench.case import BENCH_FAMILIES
    from dspzoo.core.entry import UsageError

    err = _refused(capsys, ["bench", "-n", "2", "--run", "--", "--model", "weathertx-small"],
                   monkeypatch)  # fmt: skip
    assert "'weathertx-small' is not a model the benchmark runs" in err
    assert "unknown config field" not in err
    assert all(f"{family}-*" in err for family in BENCH_FAMILIES)
    err = _refused(capsys, ["bench", "--", "--model", "stdit-huge"], monkeypatch)
    assert "unknown model 'stdit-huge'" in err  # a family it runs, a config the zoo lacks
    help_text = " ".join(build_parser().format_help().split())
    assert all(f"{family}-*" in help_text for family in BENCH_FAMILIES)  # Mamba ones too
    with pytest.raises(UsageError, match="not a model the benchmark runs"):  # the API's check
        build_case(SimpleNamespace(model="weathertx-small"), 1)


@pytest.mark.parametrize("model", ["stdit-tiny", "latte-tiny", "videomamba-tiny", "bytelm-tiny",
                                   "mambalm-tiny", "mamba2lm-tiny"])  # fmt: skip
def test_every_family_the_benchmark_takes_builds_a_case_and_steps(model: str) -> None:
    from dspzoo.core.bench.case import BENCH_FAMILIES, model_family
    from dspzoo.core.parallel.runtime import SeqParallel

    flags = ["--model", model, "--frames", "4", "--latent", "8", "--seq-len", "16"]
    case = build_case(build_parser().parse_args(flags), 1)
    loss, _ = case.step(case.model, SeqParallel(), case.inputs)
    assert loss.isfinite() and model_family(model) in BENCH_FAMILIES


def test_the_documented_default_run_is_what_the_code_runs() -> None:
    import re

    from dspzoo.core.bench.auto_choice import needs_own_row

    args = build_parser().parse_args([])
    case = build_case(args, args.batch)
    run, skipped = select_strategies(args.strategies, case, 2)
    rows = len(run) + needs_own_row(case, run, 2, 1)
    steps = 1 + (args.warmup - 1) + args.reps  # the traced step, warm-ups, timed steps
    text = " ".join((REPO / "docs" / "benchmark.md").read_text().split())
    found = re.search(r"\((\d+) strategies × (\d+) steps", text)
    assert found and (int(found[1]), int(found[2])) == (rows, steps), (found, rows, steps)
    assert skipped == {}


def test_mesh_cache_builds_each_layout_once() -> None:
    meshes = MeshCache()
    one = meshes.for_strategy("dsp", 1)
    assert meshes.for_strategy("ring", 1) is one and len(meshes) == 1


# -- the formulas the bench compares with ------------------------------------------------------
def _attention(method: str, seq: list[int], r: int, heads: int, kv: int, d: int, u: int = 1):
    out = CommCount()
    shape = AttentionShape(tuple(seq), 2, heads, kv, d, 4, u)
    get_method(method).attention_bytes(out, shape, r)
    return out.bytes(phase="forward"), out.bytes(phase="backward")


def test_even_method_formulas_are_the_textbook_units() -> None:
    n, b, length, heads, d, item = 4, 2, 64, 8, 16, 4
    m = b * length * heads * d * item  # bytes of the global activation (= of q, k or v)
    unit = m / n * (n - 1) / n
    seq = shard_sizes(length, n)
    for r in range(n):
        assert _attention("ulysses", seq, r, heads, heads, d) == (4 * unit, 4 * unit)
        assert _attention("lss", seq, r, heads, heads, d) == (2 * (n - 1) * m / n,) * 2
        fwd, bwd = _attention("ring", seq, r, heads, heads, d)
        assert fwd == 2 * (n - 1) * m / n and bwd == fwd + 2 * m
        pair = CommCount()
        megatron_pair_bytes(pair, seq, b * heads * d, item)
        assert (pair.bytes(phase="forward"), pair.bytes(phase="backward")) == (
            2 * (n - 1) * m / n,
        ) * 2
        # USP 2 × 2: Ulysses inside pairs, ring over the 2 slots
        uf, ub = _attention("usp", seq, r, heads, heads, d, 2)
        ulysses = 4 * m / n * (2 - 1) / 2
        assert uf == ulysses + 2 * (2 - 1) * m / n
        assert ub == ulysses + 2 * (2 - 1) * m / n + 2 * 2 * m / n
    # KV-aligned GQA: q and output 2 units, k and v 2·Hkv/H
    assert _attention("ulysses", seq, 0, heads, 4, d)[0] == pytest.approx(
        (2 + 2 * 4 / heads) * unit
    )
    # 2 KV heads (or MQA) at N = 4 cut KV groups: k and v are expanded to the query heads
    for kv in (2, 1):
        assert _attention("ulysses", seq, 0, heads, kv, d)[0] == 4 * unit


def test_uneven_switch_backward_sends_what_the_forward_received() -> None:
    src, dst = shard_sizes(10, 3), shard_sizes(7, 3)  # [4, 3, 3] -> [3, 2, 2]
    counts = [CommCount() for _ in range(3)]
    for r, out in enumerate(counts):
        switch_bytes(out, src, dst, r, 1)
    fwd = [c.bytes(phase="forward") for c in counts]
    assert fwd == [4 * (7 - 3), 3 * (7 - 2), 3 * (7 - 2)]
    assert sum(fwd) == sum(c.bytes(phase="backward") for c in counts)


def test_the_cost_models_walk_of_the_dsp_plan() -> None:
    n = 2
    wl = workload_for("stdit-tiny", frames=16, spatial=16, overrides={"cond_dim": 0})
    unit = wl.batch * wl.tokens * wl.hidden * wl.itemsize / n * (n - 1) / n
    dsp = comm_bytes(wl, "dsp", n, 0, exit_gather=False)
    # two switches per axial layer; the entry split saves the first layer's first one
    assert dsp.bytes("all_to_all", "forward") == (2 * wl.depth - 1) * unit
    assert dsp.bytes("all_to_all", "backward") == (2 * wl.depth - 1) * unit
    # an embedded strategy on s: one Ulysses attention per layer, no switch
    uly = comm_bytes(wl, "ulysses", n, 1, exit_gather=False)
    assert uly.bytes(phase="forward") == uly.bytes(phase="backward") == 4 * unit * wl.depth


# -- the rest of the tool ------------------------------------------------------------------------
def test_paired_ratios_and_their_spread() -> None:
    ratios = paired_ratios([2.0, 3.0, 4.0, 6.0], [1.0, 2.0, 2.0, 2.0])
    assert ratios == [2.0, 1.5, 2.0, 3.0]
    s = spread(ratios)
    assert s["median"] == 2.0 and s["min"] == 1.5 and s["q1"] <= 2.0 <= s["q3"]
    # the IQR lies inside the range however few the repetitions (the "exclusive" quartiles
    # extrapolated: 2 timings 0.015, 0.022 gave 0.013–0.024)
    two = spread([0.015, 0.022])
    assert two["min"] <= two["q1"] <= two["median"] <= two["q3"] <= two["max"]
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == {
        "median": 3.0, "q1": 2.0, "q3": 4.0, "min": 1.0, "max": 5.0
    }  # fmt: skip
    with pytest.raises(ValueError, match="3 timings against 2"):
        paired_ratios([1.0, 2.0, 3.0], [1.0, 1.0])
    before = {"median": 1.0, "q1": 0.9, "q3": 1.1}
    assert not moved_beyond_iqr(before, {"median": 1.15, "q1": 1.0, "q3": 1.3})
    assert moved_beyond_iqr(before, {"median": 1.5, "q1": 1.45, "q3": 1.55})


def test_deepspeed_cases_it_cannot_run_are_named() -> None:
    assert deepspeed_cannot_run({"t": 8, "s": 16}, "s", 4, 4, 2) is None
    assert "not divisible" in deepspeed_cannot_run({"l": 1023}, "l", 4, 4, 2)
    assert "heads 3 < SP 4" in deepspeed_cannot_run({"l": 1024}, "l", 3, 3, 4)


def test_parser_defaults_are_the_video_default() -> None:
    args = build_parser().parse_args([])
    assert (args.model, args.mode, args.warmup, args.reps, args.out, args.no_check) == (
        "stdit-mini",
        "sp",
        1,
        5,
        "outputs/bench",
        False,
    )


def test_dspzoo_bench_prints_the_launch_command(capsys) -> None:
    from dspzoo.zoo.cli import main

    assert main(["bench", "-n", "4", "--", "--model", "bytelm-tiny", "--seq-len", "64"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("accelerate launch --multi_gpu --num_processes 4 --num_machines 1")
    assert line.endswith("scripts/benchmark.py --model bytelm-tiny --seq-len 64")
    assert main(["bench", "-n", "1"]) == 0  # Accelerate refuses --multi_gpu for one process
    assert capsys.readouterr().out.startswith("accelerate launch --num_processes 1 --num_machines")
    assert main(["bench", "--", "--help"]) == 0  # the benchmark's flags, not a launch command
    assert capsys.readouterr().out.startswith("usage: benchmark.py")
    with pytest.raises(SystemExit) as refused:  # it ran the whole default benchmark in one process
        main(["bench", "-n", "0", "--run"])
    assert refused.value.code == 2
    assert "-n/--num-processes: expected a positive integer, got 0" in capsys.readouterr().err


def test_a_one_process_run_reproduces_without_a_launcher() -> None:
    import argparse

    from dspzoo.core.bench.runner import reproduce_command

    args = argparse.Namespace()
    assert reproduce_command(args, 1).startswith("python ")
    assert reproduce_command(args, 2).startswith("accelerate launch --multi_gpu --num_processes 2")


def test_the_reproduce_command_works_from_the_folder_it_ran_in(tmp_path: Path, monkeypatch) -> None:
    import argparse
    import shlex

    from dspzoo.core.bench.runner import reproduce_command

    script = REPO / "scripts" / "benchmark.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [os.path.relpath(script), "--reps", "0"])
    for world in (1, 2):
        words = shlex.split(reproduce_command(argparse.Namespace(), world))
        assert words[-3:] == [str(script), "--reps", "0"], words


def test_two_runs_side_by_side() -> None:
    from dspzoo.core.bench.compare import side_by_side

    def run(*ring: float) -> dict:
        dsp = [1.0, 1.0, 1.0, 1.0]
        return {"rows": [{"strategy": "dsp", "times": dsp}, {"strategy": "ring", "times": ring}]}

    steady = side_by_side(run(1.2, 1.3, 1.4, 1.3), run(1.25, 1.3, 1.45, 1.35))
    assert "| ring | 1.30 |" in steady and steady.endswith("| no |")
    moved = side_by_side(run(1.2, 1.3, 1.4, 1.3), run(2.0, 2.1, 2.0, 2.1))
    assert moved.endswith("| yes |")

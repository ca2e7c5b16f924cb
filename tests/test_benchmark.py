"""The benchmark (``scripts/benchmark.py``) end to end on a tiny case: 2 processes, 1 warm-up
and 2 interleaved repetitions of every strategy; its outputs agree with DSP, its traced bytes
equal the cost model's formula, and it writes results.json, results.md and results.png."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dspzoo.core.bench import build_parser
from dspzoo.core.bench.peer import deepspeed_cannot_run

REPO = Path(__file__).resolve().parents[1]


def test_deepspeed_cases_it_cannot_run_are_named() -> None:
    assert deepspeed_cannot_run({"t": 8, "s": 16}, "s", 4, 4, 2) is None
    assert "not divisible" in deepspeed_cannot_run({"l": 1023}, "l", 4, 4, 2)
    assert "heads 3 < SP 4" in deepspeed_cannot_run({"l": 1024}, "l", 3, 3, 4)


def test_parser_defaults_are_the_video_default() -> None:
    args = build_parser().parse_args([])
    assert (args.model, args.mode, args.warmup, args.out) == (
        "stdit-mini",
        "sp",
        1,
        "outputs/bench",
    )


def test_benchmark_runs_end_to_end_on_a_tiny_case(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "scripts" / "benchmark.py"),
        "--model", "stdit-tiny", "--frames", "4", "--latent", "8", "--warmup", "1",
        "--reps", "2", "--peer", "off", "--cluster", "none", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reproduce: `accelerate launch" in proc.stdout
    result = json.loads((out / "results.json").read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert list(rows)[0] == "dsp" and {"ulysses", "ring", "lss", "megatron_sp"} <= set(rows)
    assert result["skipped"]["deepspeed_ulysses"] == "--peer off"
    for name, r in rows.items():
        assert len(r["times"]) == 2 and r["time"]["min"] <= r["time"]["median"]
        assert r["max_abs_diff"] < 1e-5, name
        assert r["activation_bytes"] > 0
        assert r["formula_exact"], (name, r["bytes"], r["formula_bytes"])
    # DSP moves the fewest bytes of all (the paper's claim, exact on any machine)
    assert all(r["vs_dsp"]["bytes"] >= 1 for r in rows.values())
    assert (out / "results.png").stat().st_size > 1000
    assert "| dsp |" in (out / "results.md").read_text()


def test_end_to_end_mode_takes_the_trainers_steps(tmp_path: Path) -> None:
    """End-to-end at SP 2 (a budget nothing fits): whole optimisation steps (DDP, and
    megatron_sp's tensor-parallel path), outputs equal to DSP's, bytes equal to the formula."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "scripts" / "benchmark.py"),
        "--model", "stdit-tiny", "--frames", "4", "--latent", "8", "--warmup", "1",
        "--reps", "1", "--peer", "off", "--cluster", "none", "--no-progress", "--out", str(out),
        "--mode", "end-to-end", "--memory-budget-mib", "0.001", "--strategies", "dsp,megatron_sp",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing fits 0.001 MiB" in proc.stdout
    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"dsp", "megatron_sp"}
    for name, r in rows.items():
        assert r["max_abs_diff"] < 1e-5 and r["formula_exact"], name


def test_dspzoo_bench_prints_the_launch_command(capsys) -> None:
    from dspzoo.zoo.cli import main

    assert main(["bench", "-n", "4", "--", "--model", "bytelm-tiny", "--seq-len", "64"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("accelerate launch --multi_gpu --num_processes 4 --num_machines 1")
    assert line.endswith("scripts/benchmark.py --model bytelm-tiny --seq-len 64")

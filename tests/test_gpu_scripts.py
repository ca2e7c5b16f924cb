"""The GPU scripts run here too: scripts/bench_kernel_device.py on the CPU (its table, its
errors against float64, the CUDA error without CUDA) and scripts/gpu_checks.sh's shape (it
parses, and every test file and script it runs exists)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspzoo.core.entry import UsageError, run_entry_point

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts folder is not an installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


bench_kernel_device = _load_script("bench_kernel_device").main


def test_bench_kernel_device_on_the_cpu(capsys):
    argv = "--device cpu --seq-len 96 --heads 2 --head-dim 8 --dtype float32 --reps 2 --chunk 32"
    assert bench_kernel_device(argv.split()) == 0
    out = capsys.readouterr().out
    row = r"^\| (\w+) \| ([\d.]+) \| ([\d.]+) \| (.+?) \| (\S+) / (\S+) \|$"
    rows = {m[0]: m[1:] for m in re.findall(row, out, re.M)}
    assert set(rows) == {"sdpa", "fused", "blockwise"}
    assert rows["sdpa"][1] == "1.00"  # the ratios are to the first kernel
    for name, (_, _, peak, err_out, err_grad) in rows.items():
        assert peak == "–"  # no CUDA allocator on the CPU
        assert float(err_out) < 1e-5 and float(err_grad) < 1e-5, name  # fp32 against fp64
    assert "reproduce: python scripts/bench_kernel_device.py --device cpu" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_bench_kernel_device_cuda_without_cuda(capsys):
    """Bad input is one line and status 2 (through the scripts' entry point)."""
    assert run_entry_point(lambda: bench_kernel_device(["--device", "cuda"]), "b.py") == 2
    assert capsys.readouterr().err == (
        "b.py: error: --device cuda: CUDA is not available; use --device cpu\n"
    )
    with pytest.raises(UsageError, match="--kernels: unknown flash; choose from sdpa, fused"):
        bench_kernel_device(["--device", "cpu", "--kernels", "sdpa,flash"])
    with pytest.raises(UsageError, match="--device tpu: choose cpu, cuda or cuda:N"):
        bench_kernel_device(["--device", "tpu"])
    with pytest.raises(UsageError, match="--kernels fused-flash: these hold the fused kernel"):
        bench_kernel_device(["--device", "cpu", "--kernels", "sdpa,fused-flash"])
    for flag in ("--seq-len", "--reps", "--chunk"):  # sizes and counts of at least 1
        assert run_entry_point(lambda f=flag: bench_kernel_device([f, "0"]), "b.py") == 2
        assert f"argument {flag}: expected a positive integer, got 0" in capsys.readouterr().err


def test_gpu_checks_script_parses_and_names_what_exists():
    script = ROOT / "scripts" / "gpu_checks.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    named = set(re.findall(r"((?:tests|scripts)/[\w/]+\.py)", text))
    assert {"tests/test_cuda_resume.py", "scripts/protein_memory.py"} <= named
    for path in named:
        assert (ROOT / path).is_file(), path


def test_bench_report_names_the_gpu_and_its_peak(tmp_path):
    """A one-process CPU bench run's result, as a GPU run fills it in: the header names the
    device, the bytes table grows its 'peak GPU MiB (step)' column, and a skipped prediction
    says why; the CPU run itself names the CPU and has no such column."""
    import json
    import os

    from dspzoo.core.bench.report import markdown

    argv = "--peer off --reps 1 --warmup 1 --no-progress --frames 4 --latent 16"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            *argv.split(),
            "--out",
            str(tmp_path),
        ],
        check=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["device"] == "cpu" and result["rows"][0]["peak_device_bytes"] is None
    cpu = markdown(result)
    assert "processes on cpu" in cpu and "peak GPU" not in cpu
    result["device"] = "NVIDIA H200"
    result["rows"][0]["peak_device_bytes"] = 331 * 2**20
    result.pop("prediction_error", None)
    result["prediction_skipped"] = "no prediction: the run is on a GPU"
    gpu = markdown(result)
    assert "processes on NVIDIA H200" in gpu
    assert "peak GPU MiB (step) |" in gpu and "| 331 |" in gpu
    assert "no prediction: the run is on a GPU" in gpu


def test_case_moves_to_a_device():
    """``Case.to`` puts the model and every input on the device (meta here: no CUDA needed)."""
    from dspzoo.core.bench.case import build_case
    from dspzoo.core.bench.runner import build_parser

    args = build_parser().parse_args("--model stdit-mini --frames 4 --latent 8".split())
    case = build_case(args, 1).to("meta")
    assert all(p.device.type == "meta" for p in case.model.parameters())
    assert all(t.device.type == "meta" for t in case.inputs.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_checks_stops_at_once_without_cuda(tmp_path):
    """Without a CUDA device the script runs nothing (every CUDA case would be skipped and the
    run look green) and says so in one line, status 2."""
    import os

    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "sees no CUDA device; nothing run" in done.stderr
    assert "== tests" not in done.stdout  # no step ran


def test_gpu_checks_refuses_a_step_it_does_not_have(tmp_path):
    """A misspelt GPU_CHECKS_STEPS would skip every step and look green: it is refused first."""
    import os

    def run(steps: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "GPU_CHECKS_STEPS": steps}
        return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(tmp_path)],
                              capture_output=True, text=True, timeout=60, env=env)  # fmt: skip

    done = run("tests, kernel_bf16")
    assert done.returncode == 2
    assert "GPU_CHECKS_STEPS names 'kernel_bf16', which is no step" in done.stderr
    for empty in (",", " "):
        done = run(empty)
        assert done.returncode == 2 and "set but names no step" in done.stderr, empty


def test_a_closed_pipe_ends_a_script_quietly() -> None:
    """``scripts/bench_kernel_device.py ... | head``: every script's entry point
    (``run_entry_point``) ends quietly, status 0, when its reader has gone."""
    import os

    argv = [sys.executable, str(ROOT / "scripts" / "bench_kernel_device.py"), "--device", "cpu",
            "--seq-len", "32", "--heads", "1", "--head-dim", "8", "--reps", "1", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the table prints
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_gpu_checks_lists_each_step_once_in_its_header_and_runs_it():
    """The header's step list, the STEPS the script accepts and the steps it runs agree, and
    the sync_free step runs scripts/check_sync_free.py."""
    text = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    header = re.search(r"^# Steps: (.*?)\.\n#\n", text, re.S | re.M).group(1)
    listed = [name.strip() for name in header.replace("#", " ").split(",")]
    accepted = re.search(r'^STEPS="([^"]*)"', text, re.M).group(1).split()
    assert listed == accepted, (listed, accepted)
    run = re.findall(r'^\s*step "?([\w$]+)"? ', text, re.M)
    expanded = []
    for name in run:  # the loops' steps: bench_$name, bench_video_$precision, kernels_$dtype
        if name == "bench_$name":
            expanded += ["bench_video", "bench_text"]
        elif name == "bench_video_$precision":
            expanded += ["bench_video_bf16", "bench_video_fp16"]
        elif name == "kernels_$dtype":
            expanded += ["kernels_float32", "kernels_bfloat16", "kernels_float16"]
        else:
            expanded.append(name)
    assert expanded == accepted, (expanded, accepted)
    assert re.search(r"^step sync_free \d+ \"\$py\" scripts/check_sync_free\.py", text, re.M)
    assert "sync_free" in text.split("set -uo pipefail")[0].split("# Steps:")[0]  # described


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_check_sync_free_is_one_line_with_status_2_without_cuda():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_sync_free.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("check_sync_free.py: error: no CUDA device (torch ")
    assert done.stderr.count("\n") == 1, done.stderr

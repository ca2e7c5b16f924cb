"""The GPU scripts run here too: scripts/bench_kernel_device.py on the CPU (its table, its
errors against float64, the CUDA error without CUDA) and scripts/gpu_checks.sh's shape (it
parses, and every test file and script it runs exists)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from scripts.bench_kernel_device import main as bench_kernel_device

ROOT = Path(__file__).resolve().parents[1]


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
    assert bench_kernel_device(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_gpu_checks_script_parses_and_names_what_exists():
    script = ROOT / "scripts" / "gpu_checks.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    named = set(re.findall(r"((?:tests|scripts)/[\w/]+\.py)", text))
    assert {"tests/test_cuda_resume.py", "scripts/protein_memory.py"} <= named
    for path in named:
        assert (ROOT / path).is_file(), path

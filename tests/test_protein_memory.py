"""``scripts/protein_memory.py --one-block``: one af2-width block forward in this process, its
measured peak beside ``predicted_peak`` (on CPU here; ``--device cuda`` on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _script():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return __import__("protein_memory")
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_one_block_on_cpu_reports_measured_beside_predicted(tmp_path, capsys):
    pm = _script()
    out = tmp_path / "one.json"
    argv = ["--one-block", "32", "--msa-depth", "4", "--chunk-size", "4", "--channel-chunk", "8"]
    threads = torch.get_num_threads()
    assert pm.main([*argv, "--device", "cpu", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the mode's --threads does not leak
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())["one_block"]
    sizes = (res["residues"], res["msa_depth"], res["chunk_size"], res["channel_chunk"])
    assert sizes == (32, 4, 4, 8)
    assert res["sp"] == 1 and res["device"] == "cpu" and res["finite"] is True
    assert res["torch"] == torch.__version__ and res["device_name"] and res["seconds"] > 0
    assert res["peak_bytes"] >= res["before_bytes"] > 0 and res["reserved_peak_bytes"] is None
    # af2-width weights (1.8M parameters), m [1, 4, 32, 256] and z [1, 32, 32, 128] in fp32
    block_params = 87_900_000 / 48
    assert abs(res["weight_bytes"] / 4 - block_params) / block_params < 0.05
    assert res["input_bytes"] == 4 * (4 * 32 * 256 + 32 * 32 * 128)
    predicted = pm.predicted_peak(32, 1, 4, 4, 8)
    bare = pm.predicted_peak(32, 1, 4, 4, 8, base=0.0)
    assert res["predicted_gib"] == predicted and res["predicted_base0_gib"] == bare
    assert res["predicted_device_gib"] == bare + res["weight_bytes"] / 2**30
    measured = res["peak_bytes"] / 2**30
    assert res["ratio_device"] == pytest.approx(measured / res["predicted_device_gib"])
    assert res["ratio_with_base"] == pytest.approx(measured / predicted)
    assert f"| predicted_peak (base 0.31 GiB: CPU process) | {predicted:.3f} |" in printed
    assert f"| predicted_peak (base 0) | {bare:.3f} |" in printed
    assert "| measured peak (ru_maxrss) |" in printed
    assert "reproduce: OMP_NUM_THREADS=1 python scripts/protein_memory.py --one-block 32" in printed


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "protein_memory.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_one_block_on_cuda_without_cuda_is_one_line():
    proc = _run("--one-block", "32", "--device", "cuda")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--device cuda: CUDA is not available" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_device_and_modes_are_checked():
    assert "--device applies to --one-block only" in _run("--device", "cpu").stderr
    both = _run("--one-block", "32", "--activations", "32")
    assert both.returncode == 2 and "choose one of --one-block and --activations" in both.stderr

"""What the README documents: the zoo table and the dsp_demo command (run as written)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspzoo.domains.video  # noqa: F401  (registers the video families)
from dspzoo.zoo import count_parameters, create_model, format_count, get_config, list_models

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
VIDEO_FAMILIES = ("stdit", "latte")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _zoo_rows() -> list[list[str]]:
    lines = [line for line in _section("The zoo").splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_zoo_table_lists_every_video_model_with_its_count() -> None:
    seen = []
    for names_cell, layers, hidden, heads, params in _zoo_rows():
        names = re.findall(r"`([^`]+)`", names_cell)
        counts = re.sub(r"\(.*\)", "", params).split(" / ")
        assert len(counts) == len(names), (names_cell, params)
        for name, count in zip(names, counts, strict=True):
            config = get_config(name)
            assert (str(config.depth), str(config.hidden), str(config.heads)) == (
                layers,
                hidden,
                heads,
            ), name
            expected = format_count(count_parameters(create_model(name, device="meta")))
            assert count.strip() == expected, (
                f"{name}: README says {count!r}, `dspzoo list` {expected}"
            )
            seen.append(name)
    video = [m for m in list_models() if m.split("-")[0] in VIDEO_FAMILIES]
    assert sorted(seen) == video


def _documented_demo_command() -> list[str]:
    """The fenced ``accelerate launch … scripts/dsp_demo.py`` line of the README."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip().startswith("accelerate launch") and "scripts/dsp_demo.py" in line
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def test_demo_docstring_shows_the_readme_command() -> None:
    doc = (ROOT / "scripts" / "dsp_demo.py").read_text()
    assert shlex.join(_documented_demo_command()) in doc


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="--multi_gpu with 2 processes needs 2 GPUs where CUDA is present",
)
def test_documented_demo_command_runs_without_launcher_warnings(tmp_path) -> None:
    """Run the README's command verbatim (no user accelerate config): no "values were not
    passed" warning, and the printed check against one process passes on both ranks."""
    cmd = _documented_demo_command()
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), PYTHONWARNINGS="ignore")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "were not passed to `accelerate launch`" not in proc.stderr + proc.stdout, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    ranks = re.findall(r"loss (\S+) \(single process (\S+)\); max \|grad diff\| (\S+)", proc.stdout)
    assert len(ranks) == 2, proc.stdout
    for loss, single, grad_diff in ranks:
        assert abs(float(loss) - float(single)) <= 1e-5 and float(grad_diff) < 1e-6
    assert "2 switch(es) per layer" in proc.stdout

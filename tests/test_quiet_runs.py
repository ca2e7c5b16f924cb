"""Quiet, single-voice runs: no DDP stride warning (its cause, the weather tokenizer's gradient
layout, is fixed), Accelerate's note on a tied head recognised (and the tie restored on load),
and the glibc line printed once per launch, not once per rank."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from dspzoo.core.quiet import ACCELERATE_SAVE_LOGGER, aliased_names, recognise_tied_weights
from dspzoo.domains.weather.layers import VariableTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("variables", [1, 3])
def test_the_weather_tokenizer_gives_ddp_contiguous_gradients(variables: int) -> None:
    """DDP's bucket views are contiguous; a gradient with other strides (einsum's, for one
    variable: ``(C, C, 1)``) made it warn "Grad strides do not match bucket view strides"."""
    torch.manual_seed(0)
    tok = VariableTokenizer(variables, patch=4, hidden=32, heads=4)
    patches = torch.randn(2, 3, 5, variables, 16)
    out = tok(patches)
    assert out.shape == (2, 3, 5, 32)
    out.sum().backward()
    for name, p in tok.named_parameters():
        assert p.grad.stride() == torch.empty(p.shape).stride(), name


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, two names


class SharedStorage(nn.Module):
    """Two Parameters over one storage: not a tie the model rebuilds, so the note stays."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(self.a.data)


def _save(model: nn.Module, folder: Path, caplog) -> tuple[Accelerator, nn.Module, list[str]]:
    accelerator = Accelerator(cpu=True)
    recognise_tied_weights(accelerator)
    model = accelerator.prepare(model)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ACCELERATE_SAVE_LOGGER):
        accelerator.save_state(str(folder))
    notes = [r.getMessage() for r in caplog.records if "Removed shared tensor" in r.getMessage()]
    return accelerator, model, notes


def test_accelerates_note_on_a_tied_head_is_recognised_and_the_tie_survives(
    tmp_path: Path, caplog
) -> None:
    assert aliased_names(Tied()) == {"head.weight"}
    torch.manual_seed(0)
    saved = Tied()
    _, _, notes = _save(saved, tmp_path / "tied", caplog)
    assert notes == []
    accelerator = Accelerator(cpu=True)
    fresh = accelerator.prepare(Tied())
    accelerator.load_state(str(tmp_path / "tied"))
    assert fresh.head.weight is fresh.embed.weight
    torch.testing.assert_close(fresh.head.weight, saved.embed.weight)

    _, _, notes = _save(SharedStorage(), tmp_path / "shared", caplog)
    assert len(notes) == 1 and "{'b'}" in notes[0]  # a real shared tensor still warns


@pytest.mark.timeout(200)
def test_a_two_rank_text_run_says_each_line_once(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        str(ROOT / "scripts" / "train_text.py"), "--sp", "2", "--model", "bytelm-tiny",
        "--steps", "2", "--global-batch", "2", "--save-every", "1",
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "malloc" not in err, err  # no process-wide allocator change by default
    assert "Removed shared tensor" not in err, err
    assert "Grad strides do not match" not in err and "Traceback" not in err, err
    # a checkpoint at steps 1 and 2: one line each, naming the final folder, none of
    # Accelerate's per-file lines (which name the temporary one)
    assert err.count("dspzoo.core.train.checkpoint: checkpoint of step") == 2, err
    assert "Saving current state to" not in err and "accelerate.checkpointing" not in err, err
    assert err.count("dspzoo.text.train: done: 2 steps") == 1
    # the log lines are written above the progress bar, never into the middle of its line
    logged = [part for part in re.split(r"[\r\n]", err) if "dspzoo.text.train:" in part]
    assert any(": step 2 " in part for part in logged), err
    assert all(re.match(r"\d\d:\d\d:\d\d dspzoo", part) for part in logged), logged


@pytest.mark.timeout(200)
def test_a_resume_says_one_line_and_no_allocator_note(tmp_path: Path) -> None:
    """A default run changes nothing process-wide and says nothing about malloc; a resume is
    one line ("resumed from ..."), none of Accelerate's "All ... loaded successfully"."""
    cmd = [
        sys.executable, str(ROOT / "scripts" / "train_text.py"), "--sp", "1",
        "--model", "bytelm-tiny", "--global-batch", "2", "--save-every", "1",
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DSPZOO_KEEP_FREED_MEMORY"}
    env["OMP_NUM_THREADS"] = "1"
    first = subprocess.run([*cmd, "--steps", "1"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run(
        [*cmd, "--steps", "2", "--resume", "latest"], capture_output=True, text=True, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for err in (first.stderr, resumed.stderr):
        assert "malloc" not in err, err
    err = resumed.stderr
    assert "loaded successfully" not in err and "Loading states from" not in err, err
    assert "Loading the state of" not in err and "accelerate." not in err, err
    assert err.count("dspzoo.resume: resumed from") == 1, err

"""Evaluation and inference with the model on CUDA give what they give on the CPU.

The model cards' figures (the video model's held-out flow loss, the byte LM's held-out bits per
byte) and the inference calls and commands (``sample_video`` and ``dspzoo sample``,
``generate_text``, ``dspzoo forecast``) put their inputs where the model is; these cases run each with the model on CUDA and compare it
with the same model on the CPU. Every draw stays on CPU generators, so the two runs see the same
noise and differ only by the kernels' rounding: float32 sums in another order (and, in the
samplers, 8–30 Euler steps that carry it on). The tolerances below are a few hundred float32
ulps of the figures, far below any change a misplaced tensor or a lost draw would make.

Skipped without a CUDA device (CI); ``scripts/gpu_checks.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_marks import CUDA

from dspzoo.zoo import create_model, inference, save_pretrained

pytestmark = CUDA
REPO = Path(__file__).resolve().parents[1]
SAMPLING = {"frames": 4, "size": 16, "codec": "pixel-unshuffle", "codec_factor": 2}


def _both(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model on the CPU and a copy of it on CUDA, both in eval mode."""
    return model.eval(), copy.deepcopy(model).to("cuda").eval()


def _video_model(seed: int = 0) -> torch.nn.Module:
    """stdit-tiny with small random weights on top of adaLN-Zero (a non-trivial velocity)."""
    torch.manual_seed(seed)
    model = create_model("stdit-tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_heldout_flow_loss_on_cuda_is_the_cpu_figure() -> None:
    from dspzoo.domains.video.evaluation import heldout_flow_loss

    cpu, gpu = _both(_video_model())
    want = heldout_flow_loss(cpu, SAMPLING, clips=4, timesteps=2)
    got = heldout_flow_loss(gpu, SAMPLING, clips=4, timesteps=2)
    assert next(gpu.parameters()).is_cuda  # the figure was computed there, not moved back
    assert got == pytest.approx(want, rel=1e-5)


def test_heldout_bits_per_byte_on_cuda_is_the_cpu_figure() -> None:
    from dspzoo.domains.text.evaluation import heldout_bits_per_byte

    torch.manual_seed(0)
    cpu, gpu = _both(create_model("bytelm-tiny"))
    want = heldout_bits_per_byte(cpu, seq_len=32, windows=6, batch=4)
    got = heldout_bits_per_byte(gpu, seq_len=32, windows=6, batch=4)
    assert 6.0 < want < 10.0  # an untrained byte LM: near the 8 bits of a uniform guess
    assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny seeded models, saved as training saves them."""
    root = tmp_path_factory.mktemp("cuda_models")
    torch.manual_seed(0)
    return {
        "video": save_pretrained(
            _video_model(), root / "video", "stdit-tiny", {"sampling": SAMPLING}
        ),
        "text": save_pretrained(
            create_model("bytelm-tiny"), root / "text", "bytelm-tiny", {"training": {"seq_len": 8}}
        ),
    }


def test_sampled_clips_on_cuda_are_the_cpu_clips(folders) -> None:
    runs = {
        device: inference.sample_video(
            inference.load(folders["video"], device=device), per_class=1, steps=8, seed=3
        )
        for device in ("cpu", "cuda")
    }
    assert runs["cuda"].latents.is_cuda
    torch.testing.assert_close(
        runs["cuda"].latents.cpu(), runs["cpu"].latents, rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(runs["cuda"].video, runs["cpu"].video, rtol=1e-4, atol=1e-4)


def test_generated_text_on_cuda_is_the_cpu_text(folders) -> None:
    runs = {
        device: inference.generate_text(
            inference.load(folders["text"], device=device), "def ", max_new=12, seed=3
        )
        for device in ("cpu", "cuda")
    }
    # sampled with a CPU generator from the same (rounded alike to ~1e-6) probabilities
    assert runs["cuda"].new == runs["cpu"].new


def _command(script: str, args: list[str], cuda: bool, cwd: Path) -> subprocess.CompletedProcess:
    """One process of ``scripts/<script>.py``; ``cuda=False`` hides the GPU from it."""
    env = dict(os.environ)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,  # under gpu_checks.sh's limit for its whole tests step
        env=env,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_sample_command_runs_on_cuda(folders, tmp_path) -> None:
    """``dspzoo sample`` in one process puts the model on the GPU (its summary line names the
    device) and writes what the CPU run writes. (Its latency all-reduce runs only under a
    process group of several ranks, which one GPU cannot hold under NCCL: not covered here.)"""
    from PIL import Image

    strips = {}
    for cuda in (False, True):
        out = tmp_path / f"{'cuda' if cuda else 'cpu'}.gif"
        args = ["--model-dir", str(folders["video"]), "--steps", "4", "--per-class", "1"]
        done = _command("sample_video", [*args, "--out", str(out)], cuda, tmp_path)
        assert f"SP rank(s) on {'cuda' if cuda else 'cpu'}:" in done.stdout, done.stdout
        strips[cuda] = torch.from_numpy(np.array(Image.open(out.with_suffix(".png")))).int()
    assert strips[True].shape == strips[False].shape
    # 8-bit pixels of the same clips: rounding may move a pixel across one level, no further
    assert (strips[True] - strips[False]).abs().max() <= 1


def test_the_forecast_command_on_cuda_is_the_cpu_forecast(tmp_path) -> None:
    """``dspzoo forecast`` of the shipped weather model, two steps, on each device."""
    rmse = {}
    for cuda in (False, True):
        out = tmp_path / ("cuda" if cuda else "cpu")
        args = ["--model-dir", "weathertx-small-a1b-e1", "--steps", "2", "--out", str(out)]
        done = _command("forecast_weather", args, cuda, tmp_path)
        assert f" on {'cuda' if cuda else 'cpu'} written to " in done.stderr, done.stderr[-2000:]
        rmse[cuda] = json.loads((out / "rmse.json").read_text())
    assert rmse[True]["leads"] == rmse[False]["leads"] == [1, 2]
    assert rmse[True].keys() == rmse[False].keys()
    for key, value in rmse[False].items():
        if isinstance(value, dict | list) and key != "leads":
            assert _close(rmse[True][key], value), key


def _close(got: object, want: object, rel: float = 1e-4) -> bool:
    """Nested numbers equal within ``rel`` (dicts and lists walked; other values compared)."""
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_close(got[k], want[k], rel) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_close(g, w, rel) for g, w in zip(got, want))
    if isinstance(want, float):
        return abs(got - want) <= rel * max(abs(want), 1e-6)
    return got == want

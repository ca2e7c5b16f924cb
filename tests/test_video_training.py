"""Video training and sampling end to end: SP 2 repeats SP 1, resume continues, sampling agrees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SeqParallel, build_mesh
from dspzoo.core.testing import run_distributed
from dspzoo.domains.video.sampling import sample_video
from dspzoo.domains.video.training import VideoTrainConfig, train
from dspzoo.zoo import create_model

REPO = Path(__file__).resolve().parents[1]
COMMON = dict(
    model="stdit-tiny",
    steps=5,
    batch_size=2,
    frames=5,
    size=24,
    num_samples=32,
    log_every=1,
    warmup=2,
)


def _config(tmp_path: Path, **kw) -> VideoTrainConfig:
    return VideoTrainConfig(
        **{**COMMON, "sp": 1, "output_dir": str(tmp_path), "save_every": 0, **kw}
    )


def test_sp2_training_repeats_the_sp1_loss_sequence(tmp_path: Path) -> None:
    sp1 = train(_config(tmp_path / "sp1"))["losses"]
    assert len(sp1) == 5
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(REPO / "scripts" / "train_video.py"),
        "--sp=2",
        "--save-every=0",
        f"--output-dir={tmp_path / 'sp2'}",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sp2 = json.loads((tmp_path / "sp2" / "losses.json").read_text())
    assert sp2 == pytest.approx(sp1, rel=1e-4), (sp1, sp2)


def test_resume_continues_the_loss_sequence(tmp_path: Path) -> None:
    full = train(_config(tmp_path / "a", steps=6))["losses"]
    # a 6-step run cut off after 3 steps (checkpoint at step 3), then resumed
    first = train(_config(tmp_path / "b", steps=6, stop_after=3))["losses"]
    assert not (tmp_path / "b" / "final").exists()
    resumed = train(_config(tmp_path / "b", steps=6, resume="latest"))["losses"]
    assert first == pytest.approx(full[:3], rel=1e-6)
    assert resumed == pytest.approx(full[3:], rel=1e-5), (full, first, resumed)
    assert (tmp_path / "b" / "final" / "model.safetensors").exists()
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp*"))


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_config(tmp_path, resume="latest"))


def _sample(rank: int, world: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = create_model("stdit-tiny", num_classes=4).eval()
    with torch.no_grad():
        for p in model.parameters():  # leave adaLN-Zero's identity start
            p.add_(torch.randn_like(p) * 0.05)
    labels = torch.tensor([0, 3])
    shape = (2, 12, 5, 6, 6)
    ref = sample_video(
        model, SeqParallel(), shape, steps=3, labels=labels, guidance=2.0, progress=False
    ).latents
    got = sample_video(
        model,
        SeqParallel(build_mesh(world)),
        shape,
        steps=3,
        labels=labels,
        guidance=2.0,
        progress=False,
    ).latents
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    return got


def test_dsp_sampling_matches_single_process() -> None:
    outs = run_distributed(_sample, 2)
    assert torch.equal(outs[0], outs[1])


def test_model_init_leaves_the_dp_seeded_rng_alone(tmp_path: Path) -> None:
    """Initial weights depend on the seed only; the global RNG (seeded per DP group for noise,
    timesteps and label dropout) must not be reset by building the model."""
    from dspzoo.domains.video.codec import PixelUnshuffleCodec
    from dspzoo.domains.video.training import build_model

    cfg, codec = _config(tmp_path), PixelUnshuffleCodec()
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = build_model(cfg, 4, codec)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(99)
    b = build_model(cfg, 4, codec)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

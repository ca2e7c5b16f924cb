"""Training Mamba LMs with the Trainer (domains/mamba/training.py): a few steps on bytes,
resume, the saved model, SP 2 under ``accelerate launch`` equal to SP 1, bad flags; the video Mamba under the video Task."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspzoo.domains.mamba.training import MambaTrainConfig, train
from dspzoo.domains.text.data import stdlib_corpus
from dspzoo.zoo import from_pretrained

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def byte_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.bin"
    path.write_bytes(stdlib_corpus(cap_bytes=60_000, folder=path.parent).read_bytes())
    return path


def _config(out: Path, data: Path, **kw) -> MambaTrainConfig:
    base = dict(model="mambalm-tiny", sp=1, seq_len=19, steps=3, global_batch=2, warmup=1,
                eval_every=3, eval_windows=2, log_every=1, save_every=0, data=str(data),
                output_dir=str(out))  # fmt: skip
    return MambaTrainConfig(**{**base, **kw})


def test_mamba_lm_trains_resumes_and_saves(tmp_path: Path, byte_file: Path) -> None:
    full = train(_config(tmp_path / "full", byte_file))
    assert len(full["losses"]) == 3 and all(math.isfinite(x) for x in full["losses"])
    assert 7.0 < full["losses"][0] < 8.5  # near-uniform over 256 bytes: ~8 bits
    assert [step for step, _ in full["evals"]] == [3]
    out = tmp_path / "cut"
    first = train(_config(out, byte_file, stop_after=2))
    resumed = train(_config(out, byte_file, resume="latest"))
    assert first["losses"] + resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    model = from_pretrained(out / "final", expected_family="mambalm")
    reference = from_pretrained(tmp_path / "full" / "final")
    for (name, a), b in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_mamba2_lm_trains(tmp_path: Path, byte_file: Path) -> None:
    result = train(_config(tmp_path, byte_file, model="mamba2lm-tiny", steps=2, eval_every=0))
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])


def test_non_mamba_model_is_refused(tmp_path: Path, byte_file: Path) -> None:
    from dspzoo.core.entry import UsageError
    from dspzoo.domains.mamba.training import MambaTask

    with pytest.raises(UsageError, match="dspzoo train mamba trains mambalm, mamba2lm, hybridlm"):
        MambaTask.check_model(_config(tmp_path, byte_file, model="bytelm-tiny"))


@pytest.mark.timeout(400)
def test_three_steps_under_accelerate_launch_at_sp2_repeat_sp1(tmp_path: Path, byte_file: Path):
    """The Mamba LMs, the hybrid, a raster video Mamba DiT and the weather Mamba, 3 steps at
    SP 2 under ``accelerate launch`` (DSP: the scans by state passing over the sharded bytes or
    frames, the hybrid's attention by Ulysses, the weather's axial scans local between
    switches), and the hybrid again under ``--fsdp --activation-checkpointing``: the losses of
    the one-process run."""
    from mamba_training_driver import train_model

    models = ("mambalm-tiny", "mamba2lm-tiny", "hybridlm-tiny", "videomamba-tiny-raster",
              "weathermamba-tiny", "hybridlm-tiny@fsdp-ac")  # fmt: skip
    reference = {
        m: train_model(m, 1, "dsp", str(byte_file), tmp_path / "sp1" / m)
        for m in models
        if "@" not in m
    }
    reference["hybridlm-tiny@fsdp-ac"] = reference["hybridlm-tiny"]  # the same run, sharded
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "tests" / "mamba_training_driver.py"),
        str(byte_file), str(tmp_path), "dsp", *models,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "losses.json").read_text())
    assert sorted(got) == sorted(models)
    for model in models:
        assert got[model] == pytest.approx(reference[model], rel=1e-5), model


def test_video_mamba_trains_with_the_video_task(tmp_path: Path) -> None:
    """The video Mamba DiT has the video DiTs' interface: the video Task trains it as it is."""
    from dspzoo.domains.video.training import VideoTrainConfig
    from dspzoo.domains.video.training import train as train_video

    cfg = VideoTrainConfig(model="videomamba-tiny", sp=1, steps=2, global_batch=2, frames=2,
                           size=8, num_samples=4, log_every=1, save_every=0,
                           output_dir=str(tmp_path))  # fmt: skip
    result = train_video(cfg)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    model = from_pretrained(tmp_path / "final", expected_family="videomamba")
    assert model.config.in_channels == 12 and model.config.num_classes >= 1

"""Video training and sampling end to end: SP 2 repeats SP 1, resume continues, sampling agrees."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dspzoo.domains.video  # noqa: F401
from dspzoo.core import SeqParallel, build_mesh
from dspzoo.core.testing import run_distributed
from dspzoo.domains.video.sampling import sample_video
from dspzoo.domains.video.training import VideoTrainConfig, train
from dspzoo.zoo import create_model, load_extra

REPO = Path(__file__).resolve().parents[1]
COMMON = dict(
    model="stdit-tiny",
    steps=6,
    global_batch=2,
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


def _launch(nproc: int, out: Path, *flags: str) -> list[float]:
    """Run scripts/train_video.py on ``nproc`` gloo processes; return the loss history."""
    common = [f"--{k.replace('_', '-')}={v}" for k, v in COMMON.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        str(REPO / "scripts" / "train_video.py"),
        f"--output-dir={out}",
        "--save-every=0",
        *common,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), proc.stderr


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=2e-5, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    """One process, SP 1: the loss sequence and weights every layout must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    losses = train(_config(out, save_every=3))["losses"]
    assert len(losses) == 6
    return losses, out


def test_resume_at_another_layout_continues_the_run(reference, tmp_path: Path) -> None:
    """SP 2 under megatron_sp (tensor parallel: sharded weights, no DDP) on 2 processes for 3
    steps, then resumed as SP 3 under ring attention on 3 processes: the losses, the step-3
    weights (full tensors in the checkpoint) and the final (EMA) weights are those of the
    uninterrupted one-process run (strategy and layout change nothing but the communication)."""
    ref, ref_dir = reference
    out = tmp_path / "run"
    first, _ = _launch(2, out, "--sp=2", "--stop-after=3", "--sp-strategy=megatron_sp")
    assert first == pytest.approx(ref[:3], rel=1e-4), (ref, first)
    _assert_same_weights(ref_dir / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    progress = json.loads((out / "checkpoints" / "step_3" / "progress.json").read_text())
    assert progress["layout"] == {"world": 2, "dp": 1, "sp": 2} and progress["step"] == 3
    history, log = _launch(3, out, "--sp=3", "--resume=latest", "--sp-strategy=ring")
    assert "saved at dp 1 × sp 2 (2 processes) at dp 1 × sp 3 (3 processes)" in log
    assert history == pytest.approx(ref, rel=1e-4), (ref, history)  # whole history kept
    _assert_same_weights(ref_dir / "final", out / "final")


def test_megatron_sp_resumes_a_one_process_checkpoint(reference, tmp_path: Path) -> None:
    """The other way round: the one-process run's step-3 checkpoint (full tensors, dsp)
    resumed under megatron_sp at SP 2 (shards sliced from it; Adam moments and EMA too) ends
    like the uninterrupted run, and its final model is the full (gathered) EMA model."""
    ref, ref_dir = reference
    out = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    history, _ = _launch(2, out, "--sp=2", "--resume=latest", "--sp-strategy=megatron_sp")
    assert history == pytest.approx(ref, rel=1e-4), (ref, history)
    _assert_same_weights(ref_dir / "final", out / "final")


@pytest.mark.slow
def test_data_parallel_layouts_repeat_the_run(reference, tmp_path: Path) -> None:
    """dp 2 × sp 2 (4 processes) for 3 steps, resumed as dp 2 × sp 1: the same run again."""
    ref, ref_dir = reference
    out = tmp_path / "run"
    first, _ = _launch(4, out, "--sp=2", "--stop-after=3")
    assert first == pytest.approx(ref[:3], rel=1e-4), (ref, first)
    history, _ = _launch(2, out, "--sp=1", "--resume=latest")
    assert history == pytest.approx(ref, rel=1e-4), (ref, history)
    _assert_same_weights(ref_dir / "final", out / "final")


def test_resume_continues_the_loss_sequence(reference, tmp_path: Path) -> None:
    full, ref_dir = reference
    # a 6-step run cut off after 3 steps (checkpoint at step 3), then resumed
    first = train(_config(tmp_path, stop_after=3))["losses"]
    assert not (tmp_path / "final").exists()
    result = train(_config(tmp_path, resume="latest"))
    assert first == pytest.approx(full[:3], rel=1e-6)
    assert result["losses"] == pytest.approx(full[3:], rel=1e-5), (full, first, result)
    assert result["loss_history"] == pytest.approx(full, rel=1e-5)
    assert json.loads((tmp_path / "losses.json").read_text()) == result["loss_history"]
    _assert_same_weights(ref_dir / "final", tmp_path / "final")
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))
    settings = load_extra(tmp_path / "final")["sampling"]
    assert settings["frames"] == 5 and settings["size"] == 24 and settings["codec_factor"] == 2


def test_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    train(_config(tmp_path, steps=5, save_every=1, keep_checkpoints=2))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_4", "step_5"]  # the last step is always checkpointed


def test_short_runs_report_a_throughput(tmp_path: Path) -> None:
    result = train(_config(tmp_path, steps=2, ema=0.0))
    assert math.isfinite(result["tokens_per_s"]) and result["tokens_per_s"] > 0


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


def test_command_line_flags_describe_themselves_and_reject_bad_values(capsys) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from train_video import build_parser, parse_args
    finally:
        sys.path.remove(str(REPO / "scripts"))
    text = build_parser().format_help()
    assert "{logit-normal,uniform}" in text and "{raise,skip}" in text and "{no,fp16,bf16}" in text
    assert "samples per step over all data-parallel groups" in text
    assert ":func:" not in text and "``" not in text  # no reST markup
    cfg = parse_args(["--model", "latte-tiny"])
    assert cfg.output_dir == "outputs/latte-tiny"
    for bad in (["--timesteps", "cosine"], ["--sp", "0"], ["--class-dropout", "2"]):
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2
    assert "--class-dropout must be in [0, 1]" in capsys.readouterr().err
    # a yes/no flag is a switch, as the docs write it, and still takes a value
    assert parse_args(["--fsdp"]).fsdp is True
    assert parse_args(["--fsdp", "--activation-checkpointing"]).activation_checkpointing is True
    assert parse_args(["--fsdp", "false"]).fsdp is False and parse_args([]).fsdp is False

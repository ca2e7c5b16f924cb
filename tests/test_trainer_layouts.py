"""Every domain trained by the one Trainer gives the same losses at every dp × sp layout.

For video, text, protein, weather (with dropout 0.1) and the axial3d example: three steps on
one process, then — in one 2-process launch (gloo) — the same run at dp 1 × sp 2, at
dp 2 × sp 1 and at dp 1 × sp 2 with ``--fsdp --activation-checkpointing`` (weights sharded;
video's EMA too; the Evoformer's layers recomputed); the loss
sequences agree to rel 1e-5. Shapes are uneven at SP 2 (5 frames, 23
residues, 33 bytes, 3 weather states). Randomness is keyed by (seed, step, global sample
index), so nothing may depend on the layout: weather's dropout once was keyed by the DP rank.

The same launch resumes one-process checkpoints at SP 2 — protein and weather stopped after
step 2, and an axial3d run whose last save was interrupted between its two renames (``step_2``
moved aside as ``.old_step_2``; one rank recovers it) — and each run continues as the
uninterrupted one.

Run as a script under ``torch.distributed.run`` this file is the 2-process driver.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
RESUMED = ("protein", "weather", "axial3d")  # resumed at SP 2 from one-process checkpoints


def _byte_file(root: Path) -> Path:
    """A small deterministic byte corpus (the repository's README, repeated). Every process
    of a launch may ask at once: written aside and renamed in, so none reads it half written."""
    path = root / "corpus.bin"
    if not path.is_file():
        aside = root / f".corpus.bin.{os.getpid()}"
        aside.write_bytes((REPO / "README.md").read_bytes() * 4)
        os.replace(aside, path)
    return path


def _protein_folder(root: Path) -> Path:
    """Three real entries (one with MSAs), 4zey held out. Built aside and renamed in: every
    process of a launch may ask at once (the first rename wins, the others drop theirs)."""
    from dspzoo.domains.protein.dataset import BUILTIN_DATA

    folder = root / "chains"
    if not folder.is_dir():
        aside = root / f".chains.{os.getpid()}"
        aside.mkdir(parents=True)
        for name in ("2cviA.pdb.gz", "2q2k.cif.gz", "4zey.cif.gz"):
            shutil.copy(BUILTIN_DATA / name, aside / name)
        alignments = BUILTIN_DATA / "alignments" / "2q2k_A"
        shutil.copytree(alignments, aside / "alignments" / "2q2k_A")
        try:
            os.rename(aside, folder)
        except OSError:  # another process's folder is in place (the same files)
            shutil.rmtree(aside)
    return folder


def domains(data: Path) -> dict[str, tuple[Callable[..., dict], Callable[..., Any]]]:
    """``name → (train, make_config(**overrides))`` of every domain's tiny run."""
    from dspzoo.domains.protein.training import ProteinTrainConfig
    from dspzoo.domains.protein.training import train as train_protein
    from dspzoo.domains.text.training import TextTrainConfig
    from dspzoo.domains.text.training import train as train_text
    from dspzoo.domains.video.training import VideoTrainConfig
    from dspzoo.domains.video.training import train as train_video
    from dspzoo.domains.weather.training import WeatherTrainConfig
    from dspzoo.domains.weather.training import train as train_weather
    from dspzoo.examples.axial3d_training import Axial3DTrainConfig
    from dspzoo.examples.axial3d_training import train as train_axial3d

    shared = dict(steps=STEPS, global_batch=2, warmup=2, log_every=1, save_every=0)
    specs = {
        "video": (
            train_video,
            VideoTrainConfig,
            dict(model="stdit-tiny", frames=5, size=24, num_samples=16),
        ),
        "text": (
            train_text,
            TextTrainConfig,
            dict(model="bytelm-tiny", seq_len=33, eval_every=0, data=str(_byte_file(data))),
        ),
        "protein": (
            train_protein,
            ProteinTrainConfig,
            dict(
                model="evoformer-tiny",
                crop_size=23,
                max_msa_rows=5,
                eval_every=0,
                eval_max_length=30,
                held_out_entries="4zey",
                num_recycles=1,
                data=str(_protein_folder(data)),
            ),
        ),
        "weather": (
            train_weather,
            WeatherTrainConfig,
            dict(
                model="weathertx-tiny",
                data="a1b",
                history=3,
                leads="1",
                holdout_from=2095,
                eval_every=0,
                eval_batch=8,
                overrides="dropout=0.1",
                lr=1e-2,  # the gates grow fast enough for dropout to show in 3 steps
            ),
        ),
        "axial3d": (
            train_axial3d,
            Axial3DTrainConfig,
            dict(model="axial3d-tiny", frames=5, size=12, eval_clips=2),
        ),
    }

    def maker(config_cls: type, own: dict) -> Callable[..., Any]:
        return lambda **kw: config_cls(**{**shared, **own, **kw})

    return {name: (fn, maker(cls, own)) for name, (fn, cls, own) in specs.items()}


def _driver(data: str, out: str) -> None:
    """Both layouts of every domain on 2 processes, then the interrupted-save resume."""
    import torch.distributed as dist

    losses: dict[str, list[float]] = {}
    for name, (train, config) in domains(Path(data)).items():
        for sp in (2, 1):  # dp 1 × sp 2, then dp 2 × sp 1
            run = config(sp=sp, output_dir=str(Path(out) / f"{name}-sp{sp}"))
            losses[f"{name}/sp{sp}"] = train(run)["losses"]
        # sharded weights, dp 1 × sp 2, blocks recomputed in backward (the Evoformer's layers,
        # its pair layers while the MSA's switch back is in flight)
        run = config(sp=2, fsdp=True, activation_checkpointing=True,
                     output_dir=str(Path(out) / f"{name}-fsdp"))  # fmt: skip
        losses[f"{name}/fsdp"] = train(run)["losses"]
    for name in RESUMED:
        train, config = domains(Path(data))[name]
        resumed = train(config(sp=2, output_dir=str(Path(out) / f"{name}-cut"), resume="latest"))
        losses[f"{name}/resumed"] = resumed["losses"]
    if dist.get_rank() == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The one-process losses of every domain and those of the 2-process launch."""
    root = tmp_path_factory.mktemp("layouts")
    data, out = root / "data", root / "out"
    data.mkdir()
    reference = {}
    for name, (train, config) in domains(data).items():
        reference[name] = train(config(sp=1, output_dir=str(root / "one" / name)))["losses"]
    for name in RESUMED:  # one-process runs stopped after step 2, resumed at SP 2 by the launch
        train, config = domains(data)[name]
        train(config(sp=1, output_dir=str(out / f"{name}-cut"), stop_after=2))
    # the axial3d save of step 2 then died between its two renames
    ckpts = out / "axial3d-cut" / "checkpoints"
    os.replace(ckpts / "step_2", ckpts / ".old_step_2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), str(data), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=550, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return reference, json.loads((out / "losses.json").read_text())


@pytest.mark.parametrize("domain", ["video", "text", "protein", "weather", "axial3d"])
def test_dp2_sp1_dp1_sp2_and_fsdp_repeat_one_process(launched, domain: str) -> None:
    reference, got = launched
    assert len(reference[domain]) == STEPS
    for layout in ("sp2", "sp1", "fsdp"):
        losses = got[f"{domain}/{layout}"]
        assert losses == pytest.approx(reference[domain], rel=1e-5), (domain, layout)


def test_weather_dropout_is_active(launched, tmp_path: Path) -> None:
    """The weather runs above draw dropout masks: without dropout the third loss differs by
    ~1e-3, a hundred times the tolerance (the gated branches start at zero, so dropout shows
    in the losses from the third step on)."""
    reference, _ = launched
    train, config = domains(tmp_path)["weather"]
    plain = train(config(sp=1, overrides="", output_dir=str(tmp_path / "plain")))["losses"]
    assert plain[-1] != pytest.approx(reference["weather"][-1], rel=1e-4)


@pytest.mark.parametrize("domain", RESUMED)
def test_one_process_checkpoints_resume_at_sp2(launched, domain: str) -> None:
    """Protein and weather resume at another layout; axial3d from an interrupted save."""
    reference, got = launched
    assert got[f"{domain}/resumed"] == pytest.approx(reference[domain][2:], rel=1e-5)


if __name__ == "__main__":
    _driver(*sys.argv[1:3])

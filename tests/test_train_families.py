"""A training domain given a model of another family (or a misspelled one) refuses it at once.

Every Task declares the families it trains (``Task.families``); ``dspzoo train <domain>``
checks ``--model`` (or ``--init-from``'s weights) while parsing its flags, the Trainer before
it builds the mesh or writes the output folder: one line naming the family and the command that
trains it, status 2, no traceback, nothing written, at the default ``--sp 2`` too (no process
group needed first). One 2-process launch shows the line once and status 2 on both ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspzoo.core.entry import UsageError
from dspzoo.core.train.families import training_domains
from dspzoo.zoo.run_cli import run_passthrough

# (domain, a model of another family, its family, the command that trains that family)
WRONG_FAMILY = [
    ("text", "mambalm-tiny", "mambalm", "dspzoo train mamba"),
    ("video", "bytelm-tiny", "bytelm", "dspzoo train text"),
    ("protein", "weathertx-tiny", "weathertx", "dspzoo train weather"),
    ("weather", "evoformer-tiny", "evoformer", "dspzoo train protein"),
    ("mamba", "bytelm-tiny", "bytelm", "dspzoo train text"),
    ("axial3d", "stdit-tiny", "stdit", "dspzoo train video"),
]

TRAINS = {
    "video": ("stdit", "latte", "videomamba"),
    "text": ("bytelm",),
    "protein": ("evoformer",),
    "weather": ("weathertx", "weathermamba"),
    "mamba": ("mambalm", "mamba2lm", "hybridlm"),
    "axial3d": ("axial3d",),
}


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process launched alone (no launcher's variables), working in an empty folder."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train(domain: str, *flags: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``dspzoo train <domain> <flags>`` in this process: (exit status, stderr)."""
    status = run_passthrough("train", [domain, *flags])
    return status, capsys.readouterr().err


def test_every_domain_declares_what_it_trains() -> None:
    assert training_domains() == TRAINS


@pytest.mark.parametrize(("domain", "model", "family", "command"), WRONG_FAMILY)
def test_a_model_of_another_family_is_one_line_naming_family_and_command(
    domain: str, model: str, family: str, command: str, alone: Path, capsys
) -> None:
    out = alone / "out"
    status, err = _train(
        domain, "--sp", "1", "--model", model, "--steps", "1", "--output-dir", str(out),
        capsys=capsys,
    )  # fmt: skip
    trains = ", ".join(TRAINS[domain])
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    article = "an" if family[0] in "aeiou" else "a"
    assert err.startswith(
        f"dspzoo train {domain}: error: --model {model!r} is {article} {family} model; "
        f"dspzoo train {domain} trains {trains} models (e.g. "
    ), err
    assert f"; for {family} use {command}" in err, err
    assert not out.exists() and list(alone.iterdir()) == []  # no train_config.json, no outputs/


def test_a_family_no_domain_trains_says_so(alone: Path, capsys) -> None:
    status, err = _train("video", "--model", "latte1-tiny", capsys=capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert "'latte1-tiny' is a latte1 model; dspzoo train video trains stdit, latte, " in err
    assert err.rstrip().endswith(
        "no `dspzoo train` domain trains latte1 models (see dspzoo train video --help)"
    ), err


def test_a_domain_that_cannot_be_imported_is_named_not_ignored(monkeypatch) -> None:
    """When a domain's training script cannot be imported (its optional dependencies are
    missing), the refusal says so instead of claiming no domain trains the family."""
    import importlib

    from dspzoo.core.train import families
    from dspzoo.domains.text.training import TextTask

    real = importlib.import_module

    def without_mamba(name: str, *args, **kwargs):
        if name.endswith(".train_mamba"):
            raise ImportError("no module named 'mamba_only_dependency'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(families.importlib, "import_module", without_mamba)
    line = families.refusal(TextTask, "mambalm", "--model 'mambalm-tiny' is a mambalm model")
    assert line.endswith(
        "no `dspzoo train` domain that imports here trains mambalm models (could not import "
        "the training scripts of mamba)"
    ), line


def test_a_misspelled_model_gets_did_you_mean_at_the_default_sp(alone: Path, capsys) -> None:
    """The default ``--sp 2`` on one process would need a launcher: the name comes first."""
    status, err = _train("video", "--model", "stdit-minni", "--steps", "2", capsys=capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("dspzoo train video: error: unknown model 'stdit-minni'; did you mean")
    assert "'stdit-mini'" in err and "torch.distributed" not in err, err
    assert list(alone.iterdir()) == []


def test_init_from_weights_of_another_family_are_refused(alone: Path, capsys) -> None:
    """The family saved beside shipped weights (only their config.json is read)."""
    status, err = _train("text", "--init-from", "mambalm-mini-stdlib", capsys=capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert (
        "error: --init-from 'mambalm-mini-stdlib' holds a mambalm model; dspzoo train text "
        "trains bytelm models" in err
    ), err
    assert "for mambalm use dspzoo train mamba" in err
    assert list(alone.iterdir()) == []


def test_the_trainer_checks_before_the_mesh_and_the_output_folder(alone: Path) -> None:
    """From Python (no flag parsing): ``train(cfg)`` refuses before anything is set up, at
    ``sp=2`` without a process group."""
    from dspzoo.domains.protein.training import ProteinTrainConfig
    from dspzoo.domains.protein.training import train as train_protein
    from dspzoo.domains.video.training import VideoTrainConfig
    from dspzoo.domains.video.training import train as train_video

    out = alone / "out"
    with pytest.raises(
        UsageError, match="'stdit-tiny' is a stdit model; dspzoo train protein trains evoformer"
    ):
        train_protein(ProteinTrainConfig(model="stdit-tiny", output_dir=str(out)))
    with pytest.raises(KeyError, match="unknown model 'stdit-minni'; did you mean"):
        train_video(VideoTrainConfig(model="stdit-minni", output_dir=str(out)))
    assert not out.exists()


@pytest.mark.timeout(300)
def test_under_a_two_process_launch_the_line_is_printed_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOGLEVEL"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dspzoo", "train", "text", "--model", "mambalm-tiny", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )  # fmt: skip
    output = done.stdout + done.stderr
    line = (
        "dspzoo train text: error: --model 'mambalm-tiny' is a mambalm model; dspzoo train "
        "text trains bytelm models"
    )
    assert done.returncode != 0
    # once from the ranks, once again as the root cause at the end of the launcher's report
    assert output.count(line) == 2 and output.count(": error: ") == 2, output
    assert re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output) == ["2", "2"], output
    assert output.count("Traceback") == 1, output  # the launcher's own report of the ranks
    before, report = output.split("Traceback")
    assert line in before and "ChildFailedError" in report and f"traceback : {line}" in report
    assert "AttributeError" not in output and "usage:" not in output, output
    assert list(tmp_path.iterdir()) == []

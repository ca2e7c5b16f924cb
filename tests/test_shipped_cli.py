"""Shipped models by name, model cards, and the pass-through CLI (``dspzoo train|generate|...``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspzoo.domains.text  # noqa: F401  (registers bytelm)
import dspzoo.domains.video  # noqa: F401  (registers stdit)
from dspzoo.zoo import (
    create_model,
    from_pretrained,
    load_extra,
    model_card,
    save_pretrained,
    ship_pretrained,
    shipped,
    shipped_names,
)
from dspzoo.zoo.cli import main as cli_main

CARD = dict(
    data="the standard library's sources",
    metrics={"val_bpb": 2.5},
    command="dspzoo train text --model bytelm-tiny --steps 10",
    eval="dspzoo.domains.text.training.evaluate",
)


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    """An empty shipped-weights folder in place of the package's."""
    monkeypatch.setattr(shipped, "WEIGHTS_DIR", tmp_path / "weights")
    return tmp_path / "weights"


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return (0 if code is None else code), out, err


def _bytelm() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("bytelm-tiny")


def test_ship_and_load_by_name(weights_dir) -> None:
    model = _bytelm()
    folder = ship_pretrained(
        model, "bytelm-tiny-stdlib", config_name="bytelm-tiny", extra={"seq_len": 64}, card=CARD
    )
    assert folder == weights_dir / "bytelm-tiny-stdlib"
    assert sorted(p.name for p in folder.iterdir()) == [
        "card.json",
        "config.json",
        "model.safetensors",
    ]
    assert shipped_names() == ["bytelm-tiny-stdlib"]
    loaded = from_pretrained("ByteLM-Tiny-STDLIB")  # names ignore case
    for (key, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert got.dtype == want.dtype, key  # stored in fp16, loaded back in the model's dtype
        torch.testing.assert_close(got, want.half().to(want.dtype), rtol=0, atol=0)
    assert load_extra("bytelm-tiny-stdlib") == {"seq_len": 64}
    card = model_card("bytelm-tiny-stdlib")
    assert card.model == "bytelm-tiny" and card.metrics == {"val_bpb": 2.5}
    assert card.parameters == sum(p.numel() for p in model.parameters())


def test_shipping_checks_names_and_cards(weights_dir) -> None:
    model = _bytelm()
    with pytest.raises(ValueError, match="must start with 'bytelm-tiny-'"):
        ship_pretrained(model, "bytelm-tiny", config_name="bytelm-tiny", card=CARD)
    with pytest.raises(ValueError, match="not of the model's family"):
        ship_pretrained(model, "stdit-tiny-x", config_name="stdit-tiny", card=CARD)
    with pytest.raises(ValueError, match=r"lacks \['metrics'\]"):
        card = {k: v for k, v in CARD.items() if k != "metrics"}
        ship_pretrained(model, "bytelm-tiny-x", config_name="bytelm-tiny", card=card)
    assert shipped_names() == []  # nothing half-written is left behind


def test_unknown_shipped_name_lists_the_shipped_ones(weights_dir) -> None:
    ship_pretrained(_bytelm(), "bytelm-tiny-stdlib", config_name="bytelm-tiny", card=CARD)
    with pytest.raises(
        FileNotFoundError, match=r"did you mean 'bytelm-tiny-stdlib'\? Shipped models"
    ):
        from_pretrained("bytelm-tiny-stdli")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained("no/such/folder")  # a path is never looked up by name


def test_cli_lists_and_describes_shipped_models(weights_dir, capsys) -> None:
    code, out, _ = _run(["list", "--pretrained"], capsys)
    assert code == 0 and "no trained models" in out
    ship_pretrained(_bytelm(), "bytelm-tiny-stdlib", config_name="bytelm-tiny", card=CARD)
    code, out, _ = _run(["list", "--pretrained", "--markdown"], capsys)
    assert code == 0
    row = [line for line in out.splitlines() if "bytelm-tiny-stdlib" in line]
    assert len(row) == 1 and "val_bpb 2.5" in row[0] and CARD["command"] in row[0]
    code, out, _ = _run(["list", "--pretrained"], capsys)
    assert code == 0 and "bytelm-tiny-stdlib" in out and "  metrics: val_bpb 2.5" in out
    assert "dspzoo info <name>" in out and CARD["command"] not in out
    code, _, err = _run(["list", "--markdown"], capsys)
    assert code == 2 and "--markdown goes with --pretrained" in err
    code, out, _ = _run(["info", "bytelm-tiny-stdlib"], capsys)
    assert code == 0 and "trained bytelm-tiny" in out and CARD["eval"] in out


def test_the_pretrained_listing_fits_a_narrow_terminal(weights_dir, capsys, monkeypatch) -> None:
    """``dspzoo list --pretrained`` fits the terminal's width (``COLUMNS``, as
    ``shutil.get_terminal_size`` reads it): long data and metrics wrap beneath the model's
    line, whole words kept; narrower than the aligned columns, the model and its size go on a
    line of their own (never cut)."""
    long = {
        **CARD,
        "data": "a corpus described at length: " + "many words of description " * 8,
        "metrics": {f"model/variable_{i}/lead1/rmse": 0.5 + i for i in range(5)},
    }
    ship_pretrained(_bytelm(), "bytelm-tiny-stdlib", config_name="bytelm-tiny", card=long)
    for columns in (40, 60, 100):
        monkeypatch.setenv("COLUMNS", str(columns))
        code, out, _ = _run(["list", "--pretrained"], capsys)
        lines = out.splitlines()
        assert code == 0 and max(len(line) for line in lines) <= columns, (columns, out)
        head = "bytelm-tiny-stdlib  bytelm-tiny   115.0K params"
        if columns >= len(head):
            assert lines[0] == head
        else:  # too narrow for the columns: the name, then the model and its size in full
            assert lines[0] == "bytelm-tiny-stdlib"
            assert lines[1] == "  model: bytelm-tiny, 115.0K parameters"
        text = " ".join(line.strip() for line in lines)
        assert "trained on: " + long["data"].strip() in text  # wrapped, nothing lost
        assert "model/variable_2/lead1/rmse 2.5, … (2 more: dspzoo info)" in text
        assert len(lines) > 4  # the data and the metrics took several lines
    narrowest = shipped.pretrained_listing(width=20).splitlines()  # the floor of the width
    assert narrowest[0] == "bytelm-tiny-stdlib" and max(len(line) for line in narrowest) <= 20
    assert "model: bytelm-tiny, 115.0K parameters" in " ".join(x.strip() for x in narrowest)


def test_passthrough_errors_are_one_line_with_status_2(tmp_path, capsys) -> None:
    code, _, err = _run(["train", "pottery"], capsys)
    assert code == 2 and "unknown domain 'pottery'" in err and "Traceback" not in err
    code, out, _ = _run(["train"], capsys)
    assert code == 2 and "domains: " in out
    code, _, err = _run(["generate", str(tmp_path / "missing")], capsys)
    assert code == 2 and "does not exist" in err
    video = save_pretrained(create_model("stdit-tiny"), tmp_path / "video")
    code, _, err = _run(["generate", str(video)], capsys)
    families = "['bytelm', 'hybridlm', 'mamba2lm', 'mambalm']"
    assert code == 2 and "is a 'stdit' model" in err and families in err
    code, _, err = _run(["train", "text", "--steps", "-3"], capsys)
    assert code == 2 and "steps" in err


@pytest.mark.parametrize(
    ("words", "flag"),
    [(["--model-dir", "other"], "--model-dir"), (["--model-dir=other"], "--model-dir"),
     (["--model", "other"], "--model")],
)  # fmt: skip
def test_a_model_flag_beside_the_positional_model_is_refused(
    tmp_path, capsys, words: list[str], flag: str
) -> None:
    text = save_pretrained(_bytelm(), tmp_path / "text")
    code, out, err = _run(["generate", str(text), *words], capsys)
    assert code == 2 and out == ""
    assert "the model is given once: `dspzoo generate <model or folder>` takes it as" in err
    assert err.strip().endswith(f"so drop {flag}")


def test_generate_help_names_the_model_positionally(tmp_path, capsys) -> None:
    text = save_pretrained(_bytelm(), tmp_path / "text")
    code, out, _ = _run(["generate", str(text), "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: dspzoo generate <model or folder> [-h] [--prompt PROMPT]")
    assert "--model-dir" not in out and "python scripts/" not in out
    assert "KV cache" in out and "recurrent state" in out
    code, _, err = _run(["generate", str(text), "--bogus"], capsys)
    assert code == 2 and f"dspzoo generate {text}: error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize(
    ("command", "model"),
    [("sample", "stdit-mini-shapes"), ("predict", "evoformer-small-pdb"),
     ("forecast", "weathertx-small-a1b-e1")],
)  # fmt: skip
def test_by_model_help_leaves_out_the_model_flag(capsys, command: str, model: str) -> None:
    """The command fills ``--model-dir`` from its first word: its help does not ask for it."""
    code, out, _ = _run([command, model, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: dspzoo {command} <model or folder> [-h]")
    usage = out.split("\n\n")[0]
    assert "--model-dir" not in usage and "--model-dir MODEL_DIR" not in out  # nor as an option


def test_passthrough_runs_the_domain_scripts(tmp_path, capsys) -> None:
    out_dir = tmp_path / "run"
    code, _, err = _run(
        ["train", "text", "--sp", "1", "--model", "bytelm-tiny", "--steps", "2",
         "--seq-len", "16", "--global-batch", "2", "--eval-every", "0",
         "--output-dir", str(out_dir)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert (out_dir / "final" / "model.safetensors").is_file()
    code, out, err = _run(
        ["generate", str(out_dir / "final"), "--prompt", "def ", "--max-new", "8"], capsys
    )
    assert code == 0, err
    assert out.startswith("def ") and len(out.rstrip("\n").encode()) >= 4


def test_python_dash_m_dspzoo_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dspzoo", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "video" in done.stdout, done.stderr


@pytest.mark.parametrize("name", shipped_names() or ["(none)"])
def test_every_shipped_model_loads_by_name_with_a_complete_card(name) -> None:
    if name == "(none)":
        pytest.skip("no models shipped in this install")
    from dspzoo.zoo.cli import load_domains

    load_domains()
    model = from_pretrained(name)
    card = model_card(name)
    assert card.parameters == sum(p.numel() for p in model.parameters())
    assert card.metrics and all(isinstance(v, (int, float)) for v in card.metrics.values())
    raw = json.loads((shipped.pretrained_path(name) / "card.json").read_text())
    assert raw["command"].strip() and raw["eval"].strip()


def test_init_from_starts_a_fine_tune_from_saved_weights(tmp_path) -> None:
    from dspzoo.domains.text.training import TextTrainConfig, build_model

    source = _bytelm()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)  # unlike any seeded init
    folder = save_pretrained(source, tmp_path / "src", config_name="bytelm-tiny")
    cfg = TextTrainConfig(init_from=str(folder), output_dir=str(tmp_path / "out"))
    assert cfg.model == "bytelm-tiny"  # the config comes from the weights
    model = build_model(cfg)
    for (key, want), got in zip(source.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="holds a bytelm-tiny model but --model is bytelm-lss-12l"):
        TextTrainConfig(init_from=str(folder), model="bytelm-lss-12l")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder or shipped weights"):
        TextTrainConfig(init_from="bytelm-tiny-nowhere")


def test_an_explicit_model_that_is_the_default_name_must_match_init_from(capsys) -> None:
    """``--model stdit-tiny`` (the video script's default) with weights of stdit-mini: refused
    on the command line, as any other mismatch is, not quietly replaced by the weights'."""
    from dspzoo.core.train.flags import TrainingCLI
    from dspzoo.domains.video.training import VideoTask, VideoTrainConfig

    cli = TrainingCLI(VideoTrainConfig, None, None, "test", task=VideoTask)
    default = VideoTrainConfig.__dataclass_fields__["model"].default
    assert default == "stdit-tiny"
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--init-from", "stdit-mini-shapes", "--model", default])
    assert info.value.code == 2
    assert "holds a stdit-mini model but --model is stdit-tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # abbreviated: refused (flags are never abbreviated)
        cli.parse_args(["--init-from", "stdit-mini-shapes", "--mode", default])
    for same in (["--model", "stdit-mini"], ["--model=stdit-mini"], []):  # agreeing, or none
        assert cli.parse_args(["--init-from", "stdit-mini-shapes", *same]).model == "stdit-mini"


def test_the_zoo_page_is_current() -> None:
    """docs/zoo.md is generated from the registry and the cards: regenerate it when they change."""
    done = subprocess.run(
        [sys.executable, "scripts/zoo_page.py", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr


def test_a_reader_that_leaves_early_is_no_error() -> None:
    """``dspzoo list | head -2``: the pipe is closed before the listing is written; the
    command stops quietly with status 0 (it raised ``BrokenPipeError`` with a traceback; the
    CLI's entry point catches it for every command)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspzoo", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # gone before the command (still importing) writes a line
    try:
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, err
    finally:
        proc.kill()
    assert "Traceback" not in err and "BrokenPipe" not in err, err

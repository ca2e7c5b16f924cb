"""What a new user hit on a first day (issue 40): abbreviated and misspelt flags, start-up
imports, the weather hold-out, and smaller messages."""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

import pytest

from dspzoo.core.argparser import CommandParser, flag_given

ROOT = Path(__file__).resolve().parents[1]


def _exit_2(call, capsys) -> str:
    """What ``call`` (a parse, or the CLI's ``main``) wrote to stderr, exiting with status 2."""
    try:
        code = call()
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def test_a_flag_is_never_abbreviated_and_a_misspelt_one_names_the_closest(capsys) -> None:
    parser = CommandParser(prog="demo")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--model", default="a")
    err = _exit_2(lambda: parser.parse_args(["--step", "10"]), capsys)
    assert err == (
        "demo: error: unrecognized arguments: --step 10; did you mean '--step' → '--steps'? "
        "(see demo --help)\n"
    )
    err = _exit_2(lambda: parser.parse_args(["--modle=b"]), capsys)
    assert "did you mean '--modle' → '--model'?" in err
    assert parser.parse_args(["--steps=3", "--model", "b"]).steps == 3  # whole flags still work


def test_a_training_script_refuses_an_abbreviated_flag(capsys) -> None:
    """``dspzoo train text --sp 1 --step 10`` trained for the default --steps."""
    from dspzoo.zoo.cli import main

    err = _exit_2(lambda: main(["train", "text", "--sp", "1", "--step", "10"]), capsys)
    assert "dspzoo train text: error: unrecognized arguments: --step 10" in err
    assert "did you mean '--step' → '--steps'?" in err


def test_a_misspelt_flag_of_a_command_names_the_commands_closest_flag(capsys) -> None:
    from dspzoo.zoo.cli import main

    err = _exit_2(lambda: main(["list", "--pretraind"]), capsys)
    assert (
        "unrecognized arguments: --pretraind; did you mean '--pretraind' → '--pretrained'?" in err
    )


def test_the_model_flag_is_given_only_when_spelt_whole() -> None:
    assert flag_given("--model", ["--model", "x"]) == "--model"
    assert flag_given("--model", ["--model=x"]) == "--model"
    assert flag_given("--model", ["--mode", "x"]) is None  # refused by the parser instead
    assert flag_given("--model", ["--", "--model"]) is None


def test_every_parser_of_the_package_refuses_abbreviations() -> None:
    """A plain ``argparse.ArgumentParser`` takes ``--step`` for ``--steps``: every one the
    package builds says ``allow_abbrev=False`` (a ``CommandParser`` does by default)."""
    lax = []
    for path in ROOT.rglob("*.py"):
        if {"tests", ".venv", "outputs"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name != "ArgumentParser":
                continue
            flags = {k.arg: k.value for k in node.keywords}
            value = flags.get("allow_abbrev")
            if not (isinstance(value, ast.Constant) and value.value is False):
                lax.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not lax, f"argparse.ArgumentParser without allow_abbrev=False: {lax}"


# -- the weather domain: a year of daily data ---------------------------------------------------


def _daily_year(folder: Path, *, times: bool = True) -> Path:
    """200 daily steps from 2000-01-01 of ``t`` and ``u`` on a 6 × 8 grid, as NetCDF3 (without
    the time coordinate, only the dimension, if not ``times``)."""
    import numpy as np

    xr = pytest.importorskip("xarray")
    n = 200
    rng = np.random.default_rng(0)
    coords = {"lat": np.linspace(-40, 40, 6), "lon": np.linspace(0, 315, 8)}
    if times:
        coords["time"] = ("time", np.arange(n, dtype=float), {"units": "days since 2000-01-01"})
    fields = {
        name: (("time", "lat", "lon"), rng.normal(280, 2, (n, 6, 8)).astype(np.float32))
        for name in ("t", "u")
    }
    path = folder / ("daily.nc" if times else "no_times.nc")
    xr.Dataset(fields, coords=coords).to_netcdf(path, format="NETCDF3_64BIT", engine="scipy")
    return path


def test_a_single_year_is_held_out_by_a_date_or_a_fraction(tmp_path: Path) -> None:
    from dspzoo.domains.weather.data import (
        WeatherDataError,
        WindowSpec,
        load_fields,
        sample_index,
        train_time_index,
    )

    fields = load_fields(str(_daily_year(tmp_path)), ["t"])
    with pytest.raises(WeatherDataError) as exc:  # the year 2000 is all of the data
        train_time_index(fields, WindowSpec(holdout_from=2000))
    message = str(exc.value)
    assert (
        "every time is held out (from 2000; the data covers 2000-01-01–2000-07-18, 200 times)"
        in message
    )
    assert "--holdout-from a calendar year or a date" in message and "2000-06-01" in message
    assert "--holdout-fraction (e.g. 0.2)" in message
    by_date = WindowSpec(history=2, holdout_from="2000-06-01")
    assert train_time_index(fields, by_date).tolist() == list(range(152))  # Jan–May of 2000
    assert min(target for _, target, _ in sample_index(fields, by_date, "test")) == 151
    by_fraction = WindowSpec(history=2, holdout_fraction=0.2)
    assert train_time_index(fields, by_fraction).tolist() == list(range(160))
    assert WindowSpec(holdout_from="2000-06").holdout_from == "2000-06-01"
    assert WindowSpec(holdout_from="2060").holdout_from == 2060  # a year stays a year
    for bad in ("June", "2000-13-01"):
        with pytest.raises(WeatherDataError, match="a calendar year .* or a date"):
            WindowSpec(holdout_from=bad)
    with pytest.raises(WeatherDataError, match=r"--holdout-fraction must be in \[0, 1\)"):
        WindowSpec(holdout_fraction=1.0)


def test_a_single_year_trains_with_a_held_out_fraction(tmp_path: Path) -> None:
    import dspzoo.domains.weather  # noqa: F401  (registers weathertx)
    from dspzoo.domains.weather.training import WeatherTrainConfig, train

    cfg = WeatherTrainConfig(
        model="weathertx-tiny",
        sp=1,
        data=str(_daily_year(tmp_path)),
        variables="t",
        history=2,
        leads="1",
        holdout_fraction=0.2,
        steps=2,
        global_batch=2,
        warmup=1,
        eval_every=0,
        log_every=1,
        save_every=0,
        output_dir=str(tmp_path / "run"),
    )
    umask = os.umask(0)
    os.umask(umask)
    result = train(cfg)
    assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    # every file of the run, the checkpoint's model.safetensors included (it was 0600)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" and "checkpoints" in p.parts for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_the_weather_flags_take_a_date_and_name_the_variables(tmp_path: Path, capsys) -> None:
    from dspzoo.domains.weather.data import WeatherDataError, load_fields
    from dspzoo.domains.weather.training import WeatherTrainConfig

    path = _daily_year(tmp_path)
    cfg = WeatherTrainConfig(data=str(path), holdout_from="2000-06-01")
    cfg.validate()
    assert cfg.window().holdout_from == "2000-06-01"
    with pytest.raises(WeatherDataError) as exc:  # no --variables for a file of its own
        cfg.channel_variables()
    assert str(exc.value) == (
        f"--data {path}: name the variables to use (--variables); its gridded variables: t, u"
    )
    with pytest.raises(WeatherDataError) as exc:
        load_fields(str(_daily_year(tmp_path, times=False)), ["t"])
    assert "no_times.nc: no time coordinate" in str(exc.value)
    assert "looked for a coordinate variable named one of ['time', 't', 'valid_time']" in str(
        exc.value
    )


def test_config_json_is_json_with_infinities_read_back(tmp_path: Path) -> None:
    """A Mamba-2 config's ``time_step_limit`` is ``(0.0, inf)``: ``config.json`` held a bare
    ``Infinity`` (what ``dspzoo convert --from transformers`` writes too), which JSON has not."""
    from dspzoo.zoo import create_model, load_config, save_pretrained

    folder = save_pretrained(create_model("mamba2lm-tiny"), tmp_path / "m2")

    def refuse(constant: str) -> None:
        raise AssertionError(f"config.json holds {constant}, which is not JSON")

    meta = json.loads((folder / "config.json").read_text(), parse_constant=refuse)
    assert meta["config"]["time_step_limit"] == [0.0, "Infinity"]
    _, config = load_config(folder)
    assert config.time_step_limit == (0.0, math.inf)


def test_a_help_line_says_its_default_once() -> None:
    """``--levels`` read ``(default: all) (default: )``: a help that says its default is not
    given a second one, and an empty default reads ``none``."""
    from dspzoo.core.train.flags import build_parser
    from dspzoo.domains.protein.training import ProteinTrainConfig
    from dspzoo.domains.weather.training import WeatherTrainConfig

    for config_cls in (WeatherTrainConfig, ProteinTrainConfig):
        helps = {a.dest: a.help for a in build_parser(config_cls, None)._actions}
        assert all(h.count("(default") <= 1 for h in helps.values() if h), helps
        assert not any("(default: )" in h for h in helps.values() if h), helps
    helps = {a.dest: a.help for a in build_parser(WeatherTrainConfig, None)._actions}
    assert helps["levels"].endswith("3-D variables (default: all)")
    assert helps["static_variables"].endswith("(default: none)")
    assert helps["holdout_fraction"].endswith("(default: 0.0)")  # a zero is no "none"


# -- start-up: a command imports what it needs ---------------------------------------------------

HEAVY = ("torch", "accelerate", "matplotlib", "xarray")


def _imported(args: list[str], env: dict[str, str] | None = None) -> tuple[str, set[str]]:
    """stdout of ``python -X importtime -m dspzoo <args>`` and the top-level packages it
    imported."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dspzoo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return done.stdout, names


def test_help_imports_neither_torch_nor_a_domain() -> None:
    out, imported = _imported(["--help"])
    assert "usage: dspzoo" in out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_info_prints_its_kept_output_without_torch(tmp_path: Path) -> None:
    """``dspzoo info`` (and ``list``) need torch and every domain; what they printed is kept
    under a fingerprint of dspzoo's files, and printed again without importing torch."""
    env = {"DSPZOO_CACHE_DIR": str(tmp_path), "DSPZOO_FAMILIES": ""}
    first, imported = _imported(["info", "stdit-tiny"], env)
    assert first.startswith("stdit-tiny: ") and "torch" in imported
    again, imported = _imported(["info", "stdit-tiny"], env)
    assert again == first and not imported & set(HEAVY)


def test_the_fingerprint_follows_every_file(tmp_path: Path) -> None:
    from dspzoo.zoo.cli_cache import fingerprint

    (tmp_path / "zoo").mkdir()
    code = tmp_path / "zoo" / "registry.py"
    code.write_text("A = 1\n")
    before = fingerprint(tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")  # not code the outputs depend on
    assert fingerprint(tmp_path) == before
    code.write_text("A = 22\n")
    assert fingerprint(tmp_path) != before

"""What a new user hit on a first day (issue 40): abbreviated and misspelt flags, start-up
imports, the weather hold-out, and smaller messages."""

from __future__ import annotations

import ast
from pathlib import Path

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

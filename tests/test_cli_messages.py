"""What a new user meets at the command line: ``workload_for`` sized by dim names (what
``dspzoo plan --dims`` forwards), a broken family plugin as one line (not a traceback), and
argument errors as one line from one rank (no usage block, not once per rank)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspzoo.core.argparser import CommandParser
from dspzoo.zoo.workloads import workload_for


def test_workload_for_takes_token_lengths_by_dim_name() -> None:
    by_sizes = workload_for("axial3d-mini", frames=8, spatial=(32, 16))  # patch 4
    assert by_sizes.dims == ("t", "h", "w") and by_sizes.lengths == (8, 8, 4)
    by_dims = workload_for("axial3d-mini", dims={"t": 8, "h": 8, "w": 4})
    assert by_dims == by_sizes
    on_top = workload_for("axial3d-mini", frames=8, spatial=32, dims={"w": 3})
    assert on_top.lengths == (8, 8, 3)
    text = workload_for("bytelm-tiny", dims={"l": 300})  # a builder with a default length
    assert text.lengths == (300,)
    with pytest.raises(ValueError, match=r"with dims alone name all of them \(missing \['h'"):
        workload_for("axial3d-mini", dims={"t": 8})
    with pytest.raises(ValueError, match=r"has token dims \['t', 'h', 'w'\]; dims names \['q'\]"):
        workload_for("axial3d-mini", frames=8, spatial=32, dims={"q": 2})
    with pytest.raises(ValueError, match="integers >= 1"):
        workload_for("axial3d-mini", frames=8, spatial=32, dims={"t": 0})


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dspzoo.zoo.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_a_family_module_that_fails_to_import_is_one_line_with_status_2() -> None:
    proc = _cli(["list"], {"DSPZOO_FAMILIES": "dspzoo_no_such_family_module"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "dspzoo list: error: cannot import module 'dspzoo_no_such_family_module', named by "
        "DSPZOO_FAMILIES="
    )


def test_a_broken_family_module_under_a_training_script_is_one_line(tmp_path) -> None:
    """A training script (``TrainingCLI`` under ``run_entry_point``) whose model lookup meets
    a family module that fails to import: one line, status 2, no traceback (it was a
    traceback, status 1; ``FamilyImportError`` is bad input, a ``UsageError``)."""
    (tmp_path / "tsbroken.py").write_text("import no_such_dependency_of_tsbroken\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_axial3d.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--sp", "1", "--model", "tsformer-tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "DSPZOO_FAMILIES": "tsbroken", "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("train_axial3d.py: error: cannot import module 'tsbroken'")
    assert proc.stderr.count("\n") == 1, proc.stderr


def _parse(argv: list[str], rank: str | None, capsys) -> tuple[int, str]:
    parser = CommandParser(prog="sample_video.py")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    old = os.environ.pop("RANK", None)
    if rank is not None:
        os.environ["RANK"] = rank
    try:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
    finally:
        os.environ.pop("RANK", None)
        if old is not None:
            os.environ["RANK"] = old
    return exit_info.value.code, capsys.readouterr().err


def test_argument_errors_are_one_line_from_the_first_rank_only(capsys) -> None:
    code, err = _parse([], None, capsys)  # launched alone: no RANK
    assert code == 2
    assert err == (
        "sample_video.py: error: the following arguments are required: --model-dir "
        "(see sample_video.py --help)\n"
    )
    assert _parse(["--model-dir", "m", "--steps", "x"], "0", capsys) == (
        2,
        "sample_video.py: error: argument --steps: invalid int value: 'x' "
        "(see sample_video.py --help)\n",
    )
    assert _parse(["--model-dir", "m", "--steps", "x"], "1", capsys) == (2, "")  # rank 1: quiet
    parser = CommandParser(prog="dspzoo")
    sub = parser.add_subparsers(dest="command", required=True)
    assert isinstance(sub.add_parser("info"), CommandParser)


def test_a_misspelt_choice_names_the_closest_one(capsys, monkeypatch) -> None:
    from dspzoo.core.argparser import did_you_mean

    monkeypatch.delenv("RANK", raising=False)
    parser = CommandParser(prog="train")
    parser.add_argument("--sp-strategy", choices=["ring", "ring_zigzag", "ring_balanced"])
    for typed in ("ring_balance", "Ring_Balanced"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--sp-strategy", typed])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "; did you mean 'ring_balanced'? (see train" in err, err
    with pytest.raises(SystemExit):
        parser.parse_args(["--sp-strategy", "xyz"])
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess
    assert did_you_mean("argument --steps: invalid int value: 'x'") == ""


@pytest.mark.parametrize(
    ("argv", "flags", "example"),
    [
        (
            ["-n", "2", "--model", "stdit-tiny", "--reps", "1"],
            "(--model, --reps, …)",
            "dspzoo bench -n 2 --run -- --model stdit-tiny --reps 1",
        ),
        (
            ["--run", "--model", "x", "-n", "3"],
            "(--model, …)",
            "dspzoo bench --run -n 3 -- --model x",
        ),
    ],
)
def test_benchmark_flags_before_the_separator_say_where_they_go(
    capsys, argv: list[str], flags: str, example: str
) -> None:
    from dspzoo.zoo.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dspzoo bench: error: flags of the benchmark {flags} go after `--`: ")
    assert f": {example} (without --run: print the command)" in err
    assert err.endswith("(see dspzoo bench --help)")


def test_an_unknown_flag_of_another_command_is_still_refused(capsys) -> None:
    from dspzoo.zoo.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["list", "--foo"])
    assert exc.value.code == 2
    assert "dspzoo: error: unrecognized arguments: --foo" in capsys.readouterr().err

"""The ``dspzoo`` command line: output on success, argparse-style errors (no tracebacks)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dspzoo.zoo import count_parameters, create_model, format_count, get_config, list_models
from dspzoo.zoo.cli import load_domains
from dspzoo.zoo.cli import main as cli_main

COUNT = re.compile(r"^\d+(\.\d)?[KMB]?$")


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` → (exit code, stdout, stderr); a SystemExit gives its code."""
    out, err = _Capture(), _Capture()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout, sys.stderr = old
    return (0 if code is None else code), out.getvalue(), err.getvalue()


class _Capture:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def getvalue(self) -> str:
        return "".join(self.parts)


def test_list_shows_every_model_with_its_parameter_count() -> None:
    code, out, err = _run(["list"])
    assert code == 0 and err == ""
    load_domains()
    rows = dict(line.split() for line in out.splitlines())
    assert sorted(rows) == list_models()
    assert {"stdit-small", "latte-small", "latte-mini", "stdit-720M"} <= set(rows)
    for name, count in rows.items():
        assert COUNT.match(count), (name, count)
        assert count == format_count(count_parameters(create_model(name, device="meta"))), name


def test_info_prints_config_and_count() -> None:
    code, out, err = _run(["info", "stdit-tiny"])
    assert code == 0 and err == ""
    first, *fields = out.splitlines()
    assert first == "stdit-tiny: 233.8K parameters"
    assert any(re.match(r"^  hidden\s+64$", f) for f in fields)
    assert any(re.match(r"^  patch\s+\(1, 2, 2\)$", f) for f in fields)


def test_info_is_case_insensitive_and_prints_the_registered_name() -> None:
    code, out, err = _run(["info", "stdit-720m"])
    assert code == 0 and err == "", err
    assert out.startswith("stdit-720M: 762.3M parameters\n")
    code, out, _ = _run(["info", "STDiT-Tiny"])
    assert code == 0 and out.startswith("stdit-tiny: ")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("stdit", r"model names look like 'family-config'.*did you mean.*'stdit-tiny'"),
        ("foo-bar", r"unknown model family 'foo'"),
        ("stdit-72OM", r"unknown model 'stdit-72OM'; did you mean 'stdit-720M'"),
        ("stditt-tiny", r"unknown model family 'stditt'; did you mean 'stdit'"),
    ],
)
def test_info_unknown_names_exit_with_a_message(name: str, expected: str) -> None:
    code, out, err = _run(["info", name])
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err  # one line
    last = err.strip().splitlines()[-1]
    assert last.startswith("dspzoo info: error: "), err
    assert re.search(expected, last), last
    assert not last.startswith('dspzoo info: error: "')  # the message, not a KeyError repr


def test_bad_usage_is_one_line_without_the_usage_block() -> None:
    for argv, prog in (([], "dspzoo"), (["nosuchcommand"], "dspzoo"), (["info"], "dspzoo info")):
        code, out, err = _run(argv)
        assert code == 2 and out == "", argv
        assert err.startswith(f"{prog}: error: ") and "usage:" not in err, (argv, err)
        assert err.endswith(f"(see {prog} --help)\n") and err.count("\n") == 1, (argv, err)


def test_module_entry_point_exit_status() -> None:
    """``python -m dspzoo.zoo.cli`` (what the console script runs): status 2, no traceback."""
    bad = subprocess.run(
        [sys.executable, "-m", "dspzoo.zoo.cli", "info", "foo-bar"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "Traceback" not in bad.stderr and "unknown model family 'foo'" in bad.stderr


def test_get_config_and_create_model_ignore_case() -> None:
    load_domains()
    assert get_config("stdit-720m") is get_config("stdit-720M")
    assert get_config("LATTE-3b") is get_config("latte-3B")
    model = create_model("StDiT-TINY", device="meta", hidden=32)
    assert type(model).__name__ == "STDiT" and model.config.hidden == 32
    with pytest.raises(KeyError, match="did you mean"):
        get_config("stdit-tinyy")

"""The error policy of entry points, in one process: bad input (a ``UsageError``) is one line
with status 2; anything else is a bug and propagates with its traceback (status 1)."""

from __future__ import annotations

import pytest

from dspzoo.core import entry, errors
from dspzoo.core.entry import USER_ERRORS, run_entry_point, tell_launcher
from dspzoo.core.errors import ExistingFileError, MissingFileError, UnknownNameError, UsageError


def _raise(exc: BaseException):
    def main():
        raise exc

    return main


def test_one_usage_error_family() -> None:
    assert entry.UsageError is errors.UsageError and USER_ERRORS == (UsageError,)
    assert issubclass(UsageError, ValueError)  # callers catching ValueError keep working
    assert issubclass(MissingFileError, FileNotFoundError)
    assert issubclass(ExistingFileError, FileExistsError)
    assert issubclass(UnknownNameError, KeyError)


@pytest.mark.parametrize(
    "exc",
    [
        UsageError("--steps must be >= 1, got 0"),
        MissingFileError("--data /nope: no such file"),
        ExistingFileError("out holds checkpoints: pass --resume latest"),
        UnknownNameError("unknown model 'x'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(exc, monkeypatch, capsys) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_entry_point(_raise(exc), "prog") == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"prog: error: {exc.args[0]}\n"  # the message, not a repr


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("weight"),  # a lookup inside the library: a bug, not bad input
        ValueError("shapes differ"),
        FileNotFoundError("/tmp/never-written"),
        FileExistsError("/tmp/written-twice"),
        RuntimeError("boom"),
    ],
)
def test_anything_else_is_a_bug_with_its_traceback(exc, monkeypatch, capsys) -> None:
    """One process: the exception propagates (Python prints its traceback, status 1)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(type(exc)) as raised:
        run_entry_point(_raise(exc), "prog")
    assert raised.value is exc
    assert ": error: " not in capsys.readouterr().err


def test_a_bug_under_a_launch_without_a_group_propagates(monkeypatch) -> None:
    """Launched, but failing before the process group exists: nothing to agree on, so each
    rank's own traceback (the exception propagates)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KeyError):
        run_entry_point(_raise(KeyError("x")), "prog")


def test_the_launcher_report_ends_with_the_line(tmp_path, monkeypatch) -> None:
    """The error file is in torch's own format: its report shows the line as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    tell_launcher("prog: error: --sp 3 does not divide 2")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    report = ChildFailedError("prog", {0: failure}).format_msg()
    assert report.rstrip(" =\n").endswith("traceback : prog: error: --sp 3 does not divide 2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    tell_launcher("nothing to write to")  # without a launcher: no file, no error

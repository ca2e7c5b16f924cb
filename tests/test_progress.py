"""Progress bars in a terminal and in a log file (:mod:`dspzoo.core.progress`)."""

from __future__ import annotations

import io
import sys

import pytest

from dspzoo.core import progress
from dspzoo.core.progress import LineWriter, progress_bar


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_a_log_file_gets_whole_lines_and_no_carriage_returns(monkeypatch) -> None:
    """Not a terminal: every redraw is one line of its own, the first and the last one kept,
    the ones in between at most one per ``log_interval`` (here: none)."""
    log = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress_bar(range(500), desc="train", log_interval=3600):
        pass
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2, lines  # the bar at 0 and at the end
    assert lines[0].startswith("train:   0%") and lines[-1].startswith("train: 100%"), lines
    assert "500/500" in lines[-1]


def test_a_terminal_gets_tqdm_redrawn_in_place(monkeypatch) -> None:
    tty = _Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", tty)
    for _ in progress_bar(range(3), desc="x", mininterval=0):
        pass
    assert "\r" in tty.getvalue()  # redrawn in place, tqdm's own behaviour
    assert progress.stderr_is_terminal()


@pytest.mark.parametrize("leave", [True, False])
def test_closing_a_bar_in_a_log_leaves_no_blank_lines(monkeypatch, leave: bool) -> None:
    log = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(total=4, desc="bench", leave=leave)
    bar.update(4)
    bar.close()
    assert all(line.strip() for line in log.getvalue().splitlines())


def test_a_short_transient_bar_writes_nothing_to_a_log(monkeypatch) -> None:
    """``leave=False`` (sampling's bar): in a log a lone "0%" line would read as a hang."""
    log = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress_bar(range(50), desc="sampling", leave=False):
        pass
    assert log.getvalue() == ""


def test_the_line_writer_strips_redraw_controls() -> None:
    out = io.StringIO()
    w = LineWriter(out)
    w.write("\rtrain: 10%")
    w.write("\r")
    w.write("\n")
    assert out.getvalue() == "train: 10%\n"

"""Progress bars that read well in a terminal and in a log file.

In a terminal :func:`progress_bar` is tqdm's bar, redrawn in place. When stderr is not a
terminal (a SLURM log, ``… 2> run.log``, a CI job) tqdm would write every redraw after a
carriage return, so the log gets one ever-growing line that ``less`` and ``grep`` show as
garbage. There the bar is redrawn at most every ``log_interval`` seconds instead, each
redraw one line of its own::

    train: 100%|##########| 12/12 [00:07<00:00,  1.71it/s, bits/byte(avg10)=5.9596, tok/s=966]

(ASCII, so the log reads the same in any viewer; in a Jupyter notebook tqdm's widget as ever.)
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm as plain_tqdm
from tqdm.auto import tqdm

#: seconds between two redraws written to a log file
LOG_INTERVAL_S = 30.0


class LineWriter:
    """A text stream that turns tqdm's in-place redraws (``"\\r" + bar``) into whole lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def stderr_is_terminal() -> bool:
    """Whether stderr is an interactive terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (where tqdm.auto draws a widget)."""
    return "ipykernel" in sys.modules


def redraws_in_place() -> bool:
    """Whether a bar redraws in place here (a terminal or a notebook), rather than writing
    log lines (:func:`progress_bar`)."""
    return stderr_is_terminal() or in_notebook()


def progress_bar(
    iterable: Any = None, *, log_interval: float = LOG_INTERVAL_S, **kwargs: Any
) -> tqdm:
    """``tqdm(iterable, **kwargs)`` on stderr (a widget in a notebook); in a log file one line
    per ``log_interval`` seconds (module docstring; a ``leave=False`` bar there writes nothing
    unless it runs that long: its "0%" line alone would read as a hang). ``disable=True``
    works as in tqdm."""
    if redraws_in_place() or "file" in kwargs:
        return tqdm(iterable, **kwargs)
    logged = {
        **kwargs,
        "file": LineWriter(sys.stderr),
        "mininterval": max(kwargs.get("mininterval", 0.1), log_interval),
        "maxinterval": max(kwargs.get("maxinterval", 10.0), log_interval),
        "dynamic_ncols": False,  # no terminal to measure: a fixed bar, the postfix whole
    }
    if not kwargs.get("leave", True):  # a bar that vanishes when done: in a log, a first
        logged.setdefault("delay", log_interval)  # line only for one that runs that long
    return plain_tqdm(iterable, **logged)

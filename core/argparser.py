"""Command-line parsing whose errors are one line, printed once per launch.

``argparse`` answers a bad argument with its whole usage block and then the error; under
``accelerate launch`` every rank prints both. A :class:`CommandParser` prints only

    <prog>: error: <message> (see <prog> --help)

and exits with status 2, from the first rank of a launch only (``RANK`` unset or ``0``: every
rank parses the same argv, so every rank fails alike and exits 2; one says why). The other
ranks of a launch wait (up to :data:`PEER_WAIT_S`) before exiting, so that the launcher, which
stops every rank when one exits, does not stop the first rank before it has printed (on a
loaded machine its imports may finish seconds later); the launcher stops them as soon as the
first rank exits, and stopped (SIGTERM) they exit with 2 as well. ``--help`` still prints the
full usage. Subparsers made by ``add_subparsers`` are ``CommandParser`` s too.

Flags are never abbreviated (``allow_abbrev=False``): ``--step`` is not taken for ``--steps``
but refused, with the closest flag as a hint (``did you mean '--step' → '--steps'?``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from typing import NoReturn

from .quiet import first_of_launch

USAGE_STATUS = 2
PEER_WAIT_S = 60.0
"""How long a rank other than the first waits for the first to report the error and exit."""


#: the ``dspzoo`` commands that take a model as their first word and pass it on to their
#: script as ``--model-dir`` (:mod:`dspzoo.zoo.run_cli`, which names the script's
#: ``sys.argv[0]`` ``"dspzoo <command> <model>"``)
BY_MODEL_COMMANDS = ("sample", "predict", "forecast", "generate")
MODEL_FLAG = "--model-dir"


def _by_model(prog: str | None) -> bool:
    """Whether ``prog`` is a by-model ``dspzoo`` command as typed (``dspzoo sample <model>``)."""
    words = (prog or "").split()
    return len(words) >= 3 and words[0] == "dspzoo" and words[1] in BY_MODEL_COMMANDS


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose :meth:`error` is one line (module docstring).

    Run by a by-model ``dspzoo`` command (``dspzoo sample stdit-mini-shapes ...``), its errors
    name the command as typed (a model folder's path included), its usage and help name the
    model positionally (``dspzoo sample <model or folder>``), and its ``--model-dir``, which
    the command fills from its first word, is left out of both.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        if not args and kwargs.get("prog") is None and _by_model(sys.argv[0]):
            kwargs["prog"] = sys.argv[0]  # not its basename: a folder's path stays whole
        kwargs.setdefault("allow_abbrev", False)  # "--step" is not "--steps" (module docstring)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def add_argument(self, *names: str, **kwargs: object) -> argparse.Action:  # type: ignore[override]
        if MODEL_FLAG in names and _by_model(self.prog):
            kwargs["help"] = argparse.SUPPRESS
        return super().add_argument(*names, **kwargs)  # type: ignore[arg-type]

    def format_usage(self) -> str:
        with self._positional_model():
            return super().format_usage()

    def format_help(self) -> str:
        with self._positional_model():
            return super().format_help()

    @contextlib.contextmanager
    def _positional_model(self) -> Iterator[None]:
        """``prog`` as ``dspzoo <command> <model or folder>`` while usage or help is written."""
        typed = self.prog
        if _by_model(typed):
            self.prog = " ".join([*typed.split()[:2], "<model or folder>"])
        try:
            yield
        finally:
            self.prog = typed

    def error(self, message: str) -> NoReturn:
        message += did_you_mean(message)
        if message.startswith(UNRECOGNIZED) and "did you mean" not in message:
            message += flag_suggestion(message[len(UNRECOGNIZED) :].split(), self)
        if first_of_launch():
            line = f"{self.prog}: error: {message} (see {self.prog} --help)\n"
            self._print_message(line, sys.stderr)
            from .entry import tell_launcher  # the launcher's report ends with it, too

            tell_launcher(line.strip())
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            signal.signal(signal.SIGTERM, lambda *_: os._exit(USAGE_STATUS))
            time.sleep(PEER_WAIT_S)
        self.exit(USAGE_STATUS)


def suggestion(close: list[str]) -> str:
    """``"; did you mean 'a'?"`` or ``"; did you mean 'a', 'b' or 'c'?"`` for the names
    ``close`` (``""`` for none): the one wording of every name hint."""
    if not close:
        return ""
    quoted = [repr(c) for c in close]
    listed = ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]
    return f"; did you mean {listed}?"


def corrections(unknown: list[str], known: tuple[str, ...] | list[str]) -> str:
    """``"; did you mean 'ulyses' → 'ulysses'?"`` for the names of ``unknown`` that have a
    close one in ``known`` (compared in lower case); ``""`` when none has."""
    close = [difflib.get_close_matches(s.lower(), known, n=1, cutoff=0.6) for s in unknown]
    hints = [f"{s!r} → {c[0]!r}" for s, c in zip(unknown, close) if c]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def flag_given(flag: str, words: list[str]) -> str | None:
    """The word of ``words`` (before a ``--``) that sets option ``flag``: ``--flag`` or
    ``--flag=x`` (flags are never abbreviated); ``None``."""
    for word in words:
        if word == "--":
            return None
        if word.split("=", 1)[0] == flag:
            return flag
    return None


UNRECOGNIZED = "unrecognized arguments: "
"""How argparse begins the error of words no argument takes."""


def flag_suggestion(words: list[str], parser: argparse.ArgumentParser) -> str:
    """For the flags among ``words`` (``--step``, ``--modle=x``), the closest long flags of
    ``parser`` as ``"; did you mean '--step' → '--steps'?"`` (flags hidden from its help
    left out); ``""`` when none is close."""
    typed = [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]
    known = [
        option
        for action in parser._actions
        if action.help is not argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--")
    ]
    return corrections(typed, known)


def did_you_mean(message: str) -> str:
    """For argparse's "invalid choice: 'x' (choose from 'a', 'b', ...)", the closest choice
    as ``"; did you mean 'a'?"`` (a misspelt or miscased strategy, cluster, ...); else ``""``."""
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if found is None:
        return ""
    choices = re.findall(r"'([^']*)'", found.group(2))
    typed = found.group(1)
    by_case = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(typed.lower(), list(by_case), n=1, cutoff=0.6)
    return suggestion([by_case[close[0]]] if close else [])


def _int_at_least(text: str, least: int, expected: str) -> int:
    """``text`` as an integer ≥ ``least``, else an ``ArgumentTypeError`` saying
    ``expected <expected>, got <the value>``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 1 (a size or a count), else a usage error naming
    the value."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer ≥ 0 (a count that may be zero), else a usage error
    naming the value."""
    return _int_at_least(text, 0, "an integer ≥ 0")


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers ≥ 1 (``"1,2,4"``), else a usage error
    naming the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    values = []
    for item in items:
        try:
            values.append(positive_int(item))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
    return values

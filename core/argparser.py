"""Command-line parsing whose errors are one line, printed once per launch.

``argparse`` answers a bad argument with its whole usage block and then the error; under
``accelerate launch`` every rank prints both. A :class:`CommandParser` prints only

    <prog>: error: <message> (see <prog> --help)

and exits with status 2, from the first rank of a launch only (``RANK`` unset or ``0``: every
rank parses the same argv, so every rank fails alike and exits 2; one says why). ``--help``
still prints the full usage. Subparsers made by ``add_subparsers`` are ``CommandParser`` s too.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from .quiet import first_of_launch

USAGE_STATUS = 2


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose :meth:`error` is one line (module docstring)."""

    def error(self, message: str) -> NoReturn:
        if first_of_launch():
            line = f"{self.prog}: error: {message} (see {self.prog} --help)\n"
            self._print_message(line, sys.stderr)
        self.exit(USAGE_STATUS)

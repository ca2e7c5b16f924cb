"""The error families of dspzoo: bad input (a usage error) versus everything else (a bug).

:class:`UsageError` and its subclasses mean the user gave something wrong — a flag, a file, a
shape, a config — and the message says what and how to fix it. Command-line entry points print
them as one line with exit status 2 (:mod:`dspzoo.core.entry`). Any other exception is a bug
and is reported with its traceback.

``UsageError`` derives from ``ValueError`` so that code catching ``ValueError`` around a
validation keeps working.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad usage: a flag, file, shape or config the user must change (one line, exit status 2)."""

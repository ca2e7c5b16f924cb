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


class UnknownNameError(UsageError, KeyError):
    """A name the user gave (a model, a family, a strategy) that is not known.

    Also a ``KeyError``, the lookup's error before the usage family existed, so callers that
    catch ``KeyError`` around a registry lookup keep working. Its ``str()`` is the repr of the
    message, as for any ``KeyError``: print ``exc.args[0]``
    (:func:`dspzoo.core.entry.error_message`)."""


class MissingFileError(UsageError, FileNotFoundError):
    """A file or folder the user named (by a flag, a config or a model name) is absent.

    Also a ``FileNotFoundError``, so callers that catch it (an optional file, a fallback) keep
    working. A ``FileNotFoundError`` that is *not* this class (a file the library itself
    should have written) is a bug, reported with its traceback."""


class ExistingFileError(UsageError, FileExistsError):
    """An output the user named already exists and would be overwritten (the message says which
    flag continues or replaces it). Also a ``FileExistsError``."""

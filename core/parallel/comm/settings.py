"""The one settings object of the collective layer.

:data:`SETTINGS` is a :class:`CommSettings`; :func:`set_debug` changes it. It reads no
environment variable: a launch script that wants debug mode calls ``set_debug(True)`` on every
rank. (The collective timeout belongs to the mesh: ``build_mesh(timeout_s=...)`` or
``DSPZOO_COLLECTIVE_TIMEOUT``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class CommSettings:
    """What the collectives of :mod:`dspzoo.core.parallel.comm` read.

    Attributes:
        debug: agree before every primitive and every backward collective too, not only once
            per forward at the sharded region's entry, and compare the data of replicated
            inputs (``split``) across ranks by a checksum. Costs a control exchange per
            collective (and, on a CUDA device, a host read of the checksummed data): for
            finding which collective a rank's divergent control flow broke, not for training.
            Must be equal on every rank.
    """

    debug: bool = False

    @contextlib.contextmanager
    def changed(self, **fields: Any) -> Iterator[CommSettings]:
        """These settings changed inside the block, restored after it (tests)."""
        unknown = [k for k in fields if k.startswith("_") or not hasattr(self, k)]
        if unknown:
            raise AttributeError(f"CommSettings has no setting {unknown}")
        before = {k: getattr(self, k) for k in fields}
        for k, v in fields.items():
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in before.items():
                setattr(self, k, v)


SETTINGS = CommSettings()


def set_debug(enabled: bool) -> None:
    """Debug mode (:attr:`CommSettings.debug`): every collective agrees on its arguments."""
    SETTINGS.debug = bool(enabled)

"""Process-level performance settings for CPU runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

DEFAULT_KEEP_LIMIT = 1 << 30  # blocks below this come from (and return to) the heap


def keep_freed_memory(limit_bytes: int = DEFAULT_KEEP_LIMIT) -> bool:
    """Ask glibc's malloc to reuse freed large blocks instead of returning them to the OS.

    By default glibc maps every large tensor fresh and unmaps it on free, so each new
    activation-sized buffer pays page faults (on a 2-core machine, as much as copying it).
    Raising the mmap and trim thresholds keeps such memory in the heap for reuse — the effect
    allocators such as jemalloc/tcmalloc give PyTorch CPU jobs. The setting is process-wide
    (M_MMAP_THRESHOLD = ``limit_bytes``, M_TRIM_THRESHOLD = 2 × ``limit_bytes``) and lasts
    until the process ends. Returns False (and changes nothing) where glibc is not the
    allocator. :func:`dspzoo.core.accelerate.setup_accelerate` calls it on CPU (logged at INFO,
    opt-out-able).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, limit_bytes) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, 2 * limit_bytes) == 1
        )
    except (OSError, AttributeError):
        return False
    if ok:
        logger.debug(
            "mallopt: M_MMAP_THRESHOLD=%d, M_TRIM_THRESHOLD=%d", limit_bytes, 2 * limit_bytes
        )
    else:
        logger.debug("mallopt refused the thresholds; allocator left as is")
    return ok

"""Debug-mode consistency checks run before a collective (``DSPZOO_DEBUG=1`` / ``set_debug``).

A rank whose arguments or shapes differ from the others' would otherwise hang in the collective
or exchange garbage; with the checks on, one small all-gather of metadata first makes every rank
raise the same clear error. The flag lives on the :mod:`dspzoo.core.comm` package
(``comm._DEBUG``) so that reading or patching it there is what the checks see.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .group import all_gather_single, group_size

_PACKAGE = __package__ or "dspzoo.core.comm"

_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    )
}
_DTYPE_NAMES = {code: str(dt).removeprefix("torch.") for dt, code in _DTYPE_CODES.items()}


def _dtype_name(code: int) -> str:
    return _DTYPE_NAMES.get(code, "other")


def debug_enabled() -> bool:
    """Whether the cross-rank checks run (the package's ``_DEBUG`` flag)."""
    return bool(getattr(sys.modules[_PACKAGE], "_DEBUG", False))


def set_debug(enabled: bool) -> None:
    """Turn on cross-rank consistency checks before every collective (costs one small all-gather)."""
    sys.modules[_PACKAGE]._DEBUG = bool(enabled)


def check_consistent(
    x: torch.Tensor,
    group: Any,
    what: str,
    args: tuple[int, ...] = (),
    free_axes: tuple[int, ...] = (),
) -> None:
    """Raise on every rank if ranks disagree on a collective's arguments or tensor sizes.

    ``args`` are call arguments (dims, lengths) that must be equal; ``free_axes`` are the axes
    whose sizes legitimately differ per rank (shards).
    """
    n = group_size(group)
    if n == 1:
        return
    shape = [-1 if i in free_axes else s for i, s in enumerate(x.shape)]
    meta = [x.dim(), _DTYPE_CODES.get(x.dtype, 99), *args, *shape]
    if len(meta) > 32:
        raise ValueError(f"{what}: too many dims to check ({x.dim()})")
    meta += [0] * (32 - len(meta))
    # on the data's device: NCCL only moves CUDA tensors
    everyone = torch.empty(n * 32, dtype=torch.long, device=x.device)
    all_gather_single(everyone, torch.tensor(meta, dtype=torch.long, device=x.device), group=group)
    rows = everyone.view(n, 32).cpu()
    if not bool((rows == rows[0]).all()):
        a = 2 + len(args)
        detail = "; ".join(
            f"rank {q}: dtype={_dtype_name(int(row[1]))} ndim={int(row[0])} "
            f"args={row[2:a].tolist()} shape={row[a : a + int(row[0])].tolist()}"
            for q, row in enumerate(rows)
        )
        raise ValueError(
            f"{what}: ranks of the SP group disagree on dtypes, arguments or shapes "
            f"(-1 = sharded axis): {detail}"
        )


def debug_check(
    x: torch.Tensor,
    group: Any,
    what: str,
    args: tuple[int, ...],
    free_axes: tuple[int, ...],
    error: Exception | None,
) -> None:
    """Before a collective: raise ``error`` (this rank's own input problem) on every rank.

    With debug mode on, runs :func:`check_consistent` with a flag for the local error, so all
    ranks raise together; without it, only the rank that found the problem raises.
    """
    if debug_enabled():
        try:
            check_consistent(x, group, what, (*args, int(error is None)), free_axes)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (last arg 0 = that rank found its input invalid: {error})"
            ) from error
    if error is not None:
        raise error

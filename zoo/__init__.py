"""dspzoo.zoo: the model registry, named configs and pretrained folders.

Its names are imported on first use (``dspzoo --help`` imports :mod:`dspzoo.zoo.cli`, and with
it this package, but not torch).
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any as _Any

_API = {
    **dict.fromkeys(("ENTRY_POINT_GROUP", "ENV_VAR", "load_families"), ".families"),
    **dict.fromkeys(
        (
            "CheckpointMismatchError",
            "from_pretrained",
            "load_config",
            "load_extra",
            "load_weights",
            "save_pretrained",
            "ship_pretrained",
        ),
        ".pretrained",
    ),
    **dict.fromkeys(
        (
            "count_parameters",
            "create_model",
            "family_of",
            "format_count",
            "get_config",
            "list_models",
            "register_config",
            "register_family",
            "resolve_name",
            "unregister_family",
        ),
        ".registry",
    ),
    **dict.fromkeys(("list_pretrained", "model_card", "shipped_names"), ".shipped"),
}


def __getattr__(name: str) -> _Any:
    """The names of ``__all__``, imported from their module on first use."""
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_API[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


__all__ = sorted(_API)

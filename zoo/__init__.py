"""dspzoo.zoo: the model registry, named configs and pretrained folders."""

from .pretrained import (
    CheckpointMismatchError,
    from_pretrained,
    load_config,
    load_extra,
    load_weights,
    save_pretrained,
)
from .registry import (
    count_parameters,
    create_model,
    family_of,
    format_count,
    get_config,
    list_models,
    register_config,
    register_family,
    resolve_name,
    unregister_family,
)

__all__ = [
    "CheckpointMismatchError",
    "count_parameters",
    "create_model",
    "family_of",
    "format_count",
    "from_pretrained",
    "get_config",
    "list_models",
    "load_config",
    "load_extra",
    "load_weights",
    "register_config",
    "register_family",
    "resolve_name",
    "save_pretrained",
    "unregister_family",
]

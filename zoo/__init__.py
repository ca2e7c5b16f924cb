"""dspzoo.zoo: the model registry, named configs and pretrained folders."""

from .families import ENTRY_POINT_GROUP, ENV_VAR, load_families
from .pretrained import (
    CheckpointMismatchError,
    from_pretrained,
    load_config,
    load_extra,
    load_weights,
    save_pretrained,
    ship_pretrained,
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
from .shipped import list_pretrained, model_card, shipped_names

__all__ = [
    "CheckpointMismatchError",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "count_parameters",
    "create_model",
    "family_of",
    "format_count",
    "from_pretrained",
    "get_config",
    "list_models",
    "list_pretrained",
    "load_families",
    "model_card",
    "ship_pretrained",
    "shipped_names",
    "load_config",
    "load_extra",
    "load_weights",
    "register_config",
    "register_family",
    "resolve_name",
    "save_pretrained",
    "unregister_family",
]

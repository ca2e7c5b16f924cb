"""Converters from other libraries' checkpoint folders to zoo model folders.

``diffusers_latte``: a diffusers ``LatteTransformer3DModel`` folder → a ``latte1`` zoo model
(``dspzoo convert --from diffusers <folder> <out>``).
"""

from .diffusers_latte import (
    ConversionError,
    convert_diffusers_latte,
    convert_folder,
    diffusers_config,
    latte1_config_from_diffusers,
    name_map,
    to_diffusers_state_dict,
)

__all__ = [
    "ConversionError",
    "convert_diffusers_latte",
    "convert_folder",
    "diffusers_config",
    "latte1_config_from_diffusers",
    "name_map",
    "to_diffusers_state_dict",
]

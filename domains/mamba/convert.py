"""transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` checkpoints → :class:`~.lm.MambaLM`.

The parameter names are the same (:mod:`.lm`), so converting is reading: the config
(``config.json``, ``model_type`` ``mamba`` or ``mamba2``) gives a :class:`~.lm.MambaLMConfig`,
the weights (``model.safetensors`` or a sharded ``model.safetensors.index.json``) load as they
are, after two checks that make a wrong checkpoint fail with its reason: every name and shape
must match (a Mamba-2 checkpoint for a Mamba-1 model names the missing and unexpected tensors),
and a tied head may be absent. transformers' old name ``backbone.embedding.`` is accepted.
``dspzoo convert --from transformers <folder> <out>`` writes a zoo folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dspzoo.core.safetensors_folder import ConversionError, load_tensors, weight_files

from ...core.errors import MissingFileError
from .lm import MambaLM, MambaLMConfig, lm_class

CONFIG_FILE = "config.json"
WEIGHTS_STEM = "model"
FAMILY = {1: "mambalm", 2: "mamba2lm"}
_ARCHITECTURE = {1: "MambaForCausalLM", 2: "Mamba2ForCausalLM"}
_MODEL_TYPE = {"mamba": 1, "mamba2": 2}
_COMMON = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "state_size",
    "expand",
    "conv_kernel",
    "use_bias",
    "use_conv_bias",
    "layer_norm_epsilon",
    "residual_in_fp32",
    "tie_word_embeddings",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
)
_ONLY = {1: ("time_step_rank",), 2: ("num_heads", "head_dim", "n_groups", "chunk_size")}


def config_from_transformers(config: dict[str, Any]) -> MambaLMConfig:
    """A transformers ``MambaConfig`` / ``Mamba2Config`` (as a dict, e.g. ``config.json`` or
    ``cfg.to_dict()``) → :class:`MambaLMConfig`."""
    model_type = config.get("model_type")
    if model_type not in _MODEL_TYPE:
        raise ConversionError(
            f"model_type {model_type!r} is not a transformers Mamba model; this converter reads "
            f"{sorted(_MODEL_TYPE)} (MambaForCausalLM / Mamba2ForCausalLM)"
        )
    version = _MODEL_TYPE[model_type]
    if version == 2 and not config.get("rms_norm", True):
        raise ConversionError("Mamba-2 configs with rms_norm=false have no zoo equivalent")
    if config.get("time_step_scale", 1.0) != 1.0 and version == 1:
        raise ConversionError("time_step_scale != 1 changes the forward; not supported")
    values = {k: config[k] for k in (*_COMMON, *_ONLY[version]) if k in config}
    if version == 2 and "time_step_limit" in config:
        values["time_step_limit"] = tuple(_json_float(v) for v in config["time_step_limit"])
    return MambaLMConfig(version=version, **values)


def _json_float(value: Any) -> float:
    """A float as transformers writes it to JSON (``{"__float__": "Infinity"}`` for ±inf, nan)."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    if isinstance(value, int | float | str):
        return float(value)
    raise ConversionError(f"time_step_limit holds {value!r}, not a number")


def transformers_config(config: MambaLMConfig) -> dict[str, Any]:
    """The transformers config dict of a zoo Mamba LM config (``MambaConfig(**d)`` builds it)."""
    out = {k: getattr(config, k) for k in (*_COMMON, *_ONLY[config.version])}
    out["model_type"] = "mamba" if config.version == 1 else "mamba2"
    if config.version == 2:
        out["time_step_limit"] = list(config.time_step_limit)
    return out


def prepare_state_dict(
    state: dict[str, torch.Tensor], config: MambaLMConfig
) -> dict[str, torch.Tensor]:
    """transformers' tensors by name → the state dict :class:`MambaLM` loads strictly.

    Renames the legacy ``backbone.embedding.``, fills a tied ``lm_head.weight`` and raises a
    :class:`ConversionError` naming missing, unexpected or mis-shaped tensors.
    """
    state = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in state.items()}
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in lm_class(config.version)(config).state_dict().items()}
    if config.tie_word_embeddings:
        if "lm_head.weight" in state and not torch.equal(
            state["lm_head.weight"],
            state.get("backbone.embeddings.weight", state["lm_head.weight"]),
        ):
            raise ConversionError(
                "the config ties lm_head to the embeddings (tie_word_embeddings=true) but the "
                "checkpoint's lm_head.weight differs from backbone.embeddings.weight"
            )
        if "backbone.embeddings.weight" in state:
            state["lm_head.weight"] = state["backbone.embeddings.weight"]
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ConversionError(
            f"the checkpoint is not a {_ARCHITECTURE[config.version]} of this config: missing "
            f"{_listing(missing)}, unexpected {_listing(unexpected)}"
        )
    wrong = [
        f"{k} {tuple(v.shape)} (want {want[k]})"
        for k, v in state.items()
        if tuple(v.shape) != want[k]
    ]
    if wrong:
        raise ConversionError(f"tensors of the wrong shape: {_listing(wrong)}")
    return state


def _listing(items: list[str], limit: int = 6) -> str:
    if not items:
        return "none"
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def load_transformers_state_dict(state: dict[str, torch.Tensor], config: MambaLMConfig) -> MambaLM:
    """A :class:`MambaLM` holding transformers' tensors ``state`` (same names)."""
    model = lm_class(config.version)(config)
    model.load_state_dict(prepare_state_dict(state, config), strict=True)
    return model


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_folder(folder: str | os.PathLike) -> tuple[MambaLMConfig, dict[str, torch.Tensor]]:
    """The config and tensors of a transformers Mamba folder (``save_pretrained``'s output)."""
    path = Path(folder)
    if not (path / CONFIG_FILE).is_file():
        raise MissingFileError(f"{path} has no {CONFIG_FILE}: not a transformers model folder")
    config = config_from_transformers(_read_json(path / CONFIG_FILE))
    state = load_tensors(weight_files(path, WEIGHTS_STEM, pickled_glob="pytorch_model*.bin"))
    return config, state


def convert_transformers_mamba(folder: str | os.PathLike) -> MambaLM:
    """The zoo model of a transformers ``MambaForCausalLM``/``Mamba2ForCausalLM`` folder (eval
    mode, the checkpoint's dtype)."""
    config, state = read_folder(folder)
    model = load_transformers_state_dict({k: v.float() for k, v in state.items()}, config)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    return model.to(floats.pop() if len(floats) == 1 else torch.float32).eval()


def convert_folder(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert transformers folder ``src`` into zoo folder ``dst`` (atomic); returns ``dst``."""
    from dspzoo.zoo.pretrained import save_pretrained

    model = convert_transformers_mamba(src)
    extra = {"converted_from": "transformers", "source": str(Path(src).resolve())}
    return save_pretrained(model, dst, extra=extra)

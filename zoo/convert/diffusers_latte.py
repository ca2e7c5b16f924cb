"""diffusers ``LatteTransformer3DModel`` folder → ``latte1`` zoo model.

A diffusers model folder holds ``config.json`` (``"_class_name": "LatteTransformer3DModel"``)
and ``diffusion_pytorch_model.safetensors`` — or shards listed in
``diffusion_pytorch_model.safetensors.index.json``, or a variant such as
``diffusion_pytorch_model.fp16.safetensors``. A pipeline folder (``model_index.json`` with a
``transformer/`` subfolder, as Latte-1 is published) is accepted too: its ``transformer/`` is
used.

::

    model = convert_diffusers_latte("Latte-1/transformer")        # a Latte1, eval mode
    convert_folder("Latte-1/transformer", "latte-1-zoo")           # → from_pretrained folder

Renaming (:func:`name_map`): q, k and v projections are stacked into one ``qkv`` linear (k, v
into ``kv`` for cross-attention), the patch Conv2d becomes a linear over ``(row, col,
channel)``-ordered patches, everything else is a one-to-one rename. The position tables are not
in the checkpoint (non-persistent buffers in diffusers) and are recomputed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import dspzoo.domains.video  # noqa: F401  (registers the latte1 family)
from dspzoo.core.safetensors_folder import ConversionError, load_tensors, weight_files
from dspzoo.domains.video.latte1 import ACTIVATIONS, Latte1, Latte1Config
from dspzoo.zoo.pretrained import save_pretrained

from ...core.errors import MissingFileError

CLASS_NAME = "LatteTransformer3DModel"
CONFIG_FILE = "config.json"
WEIGHTS_STEM = "diffusion_pytorch_model"
# non-persistent buffers in diffusers; tolerated (and ignored) if a checkpoint carries them
RECOMPUTED = ("pos_embed.pos_embed", "temp_pos_embed")
# LatteTransformer3DModel.__init__'s defaults, for fields a hand-written config.json omits
DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 16,
    "attention_head_dim": 88,
    "in_channels": None,
    "out_channels": None,
    "num_layers": 1,
    "dropout": 0.0,
    "cross_attention_dim": None,
    "attention_bias": False,
    "sample_size": 64,
    "patch_size": None,
    "activation_fn": "geglu",
    "num_embeds_ada_norm": None,
    "norm_type": "layer_norm",
    "norm_elementwise_affine": True,
    "norm_eps": 1e-5,
    "caption_channels": None,
    "video_length": 16,
}


# -- the folder --------------------------------------------------------------------------------
def model_folder(folder: str | os.PathLike) -> Path:
    """The diffusers model folder to read: ``folder`` itself or a pipeline's ``transformer/``."""
    path = Path(folder)
    if not path.exists():
        raise MissingFileError(f"diffusers folder {path} does not exist")
    if not path.is_dir():
        raise MissingFileError(
            f"{path} is a file; pass the diffusers model folder that holds {CONFIG_FILE} and "
            f"{WEIGHTS_STEM}.safetensors"
        )
    if (path / CONFIG_FILE).is_file():
        return path
    if (path / "transformer" / CONFIG_FILE).is_file():
        return path / "transformer"
    raise MissingFileError(
        f"{path} has no {CONFIG_FILE} (a diffusers model folder holds {CONFIG_FILE} and "
        f"{WEIGHTS_STEM}.safetensors; a pipeline folder, its transformer/ subfolder)"
    )


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a diffusers model folder, checked to be a LatteTransformer3DModel."""
    file = folder / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{file} must hold a JSON object, got {type(config).__name__}")
    found = config.get("_class_name")
    if found != CLASS_NAME:
        what = f"a {found}" if found else "not a diffusers model config (no _class_name)"
        raise ConversionError(
            f"{file} is {what}; this converter reads {CLASS_NAME} folders (Latte-1's transformer/)"
        )
    return config


def latte1_config_from_diffusers(config: dict[str, Any]) -> Latte1Config:
    """The :class:`Latte1Config` of a ``LatteTransformer3DModel`` config dict.

    Raises :class:`ConversionError` naming the field for options this architecture does not
    reproduce (another ``norm_type``, an unsupported ``activation_fn``, a cross-attention
    width other than the model width) and for unknown fields.
    """
    unknown = sorted(k for k in config if not k.startswith("_") and k not in DIFFUSERS_DEFAULTS)
    if unknown:
        raise ConversionError(
            f"config.json has fields {unknown} that LatteTransformer3DModel (diffusers 0.30–0.42) "
            f"does not have; known: {sorted(DIFFUSERS_DEFAULTS)}"
        )
    c = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    for field in ("in_channels", "patch_size", "caption_channels"):
        if c[field] is None:
            raise ConversionError(f"config.json: {field} is required (got null or absent)")
    if c["norm_type"] != "ada_norm_single":
        raise ConversionError(
            f"config.json: norm_type={c['norm_type']!r} is not supported; Latte-1 uses "
            f"'ada_norm_single' (adaLN-single), the only one this converter reproduces"
        )
    if c["activation_fn"] not in ACTIVATIONS:
        raise ConversionError(
            f"config.json: activation_fn={c['activation_fn']!r} is not supported; use one of "
            f"{sorted(ACTIVATIONS)} (Latte-1: 'gelu-approximate')"
        )
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    if c["cross_attention_dim"] not in (None, hidden):
        raise ConversionError(
            f"config.json: cross_attention_dim={c['cross_attention_dim']} must equal "
            f"num_attention_heads·attention_head_dim = {hidden} (the caption projection's "
            f"width) or be null"
        )
    if not isinstance(c["sample_size"], int):
        raise ConversionError(
            f"config.json: sample_size must be one integer, got {c['sample_size']!r}"
        )
    return Latte1Config(
        in_channels=c["in_channels"],
        out_channels=c["out_channels"] or c["in_channels"],
        heads=c["num_attention_heads"],
        head_dim=c["attention_head_dim"],
        depth=c["num_layers"],
        patch=c["patch_size"],
        sample_size=c["sample_size"],
        video_length=c["video_length"],
        caption_channels=c["caption_channels"],
        cross_attention=c["cross_attention_dim"] is not None,
        attention_bias=bool(c["attention_bias"]),
        norm_eps=float(c["norm_eps"]),
        norm_elementwise_affine=bool(c["norm_elementwise_affine"]),
        activation=c["activation_fn"],
    )


def load_diffusers_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s) (single, sharded, or one variant), by
    diffusers name."""
    files = weight_files(folder, WEIGHTS_STEM, pickled_glob=f"{WEIGHTS_STEM}*.bin", variants=True)
    return load_tensors(files)


# -- renaming ----------------------------------------------------------------------------------
def name_map(config: Latte1Config) -> dict[str, tuple[str, ...]]:
    """Zoo parameter name → the diffusers tensor(s) it is made of (several: stacked on dim 0)."""
    rules: dict[str, tuple[str, ...]] = {}

    def linear(zoo: str, source: str, bias: bool = True) -> None:
        rules[f"{zoo}.weight"] = (f"{source}.weight",)
        if bias:
            rules[f"{zoo}.bias"] = (f"{source}.bias",)

    def stacked(zoo: str, sources: list[str], bias: bool) -> None:
        rules[f"{zoo}.weight"] = tuple(f"{s}.weight" for s in sources)
        if bias:
            rules[f"{zoo}.bias"] = tuple(f"{s}.bias" for s in sources)

    linear("x_embed", "pos_embed.proj")  # Conv2d → Linear (reshaped)
    linear("t_embed.mlp.0", "adaln_single.emb.timestep_embedder.linear_1")
    linear("t_embed.mlp.2", "adaln_single.emb.timestep_embedder.linear_2")
    linear("t_mod", "adaln_single.linear")
    linear("caption.0", "caption_projection.linear_1")
    linear("caption.2", "caption_projection.linear_2")
    bias = config.attention_bias
    for kind, source in (
        ("spatial", "transformer_blocks"),
        ("temporal", "temporal_transformer_blocks"),
    ):
        for i in range(config.depth):
            z, d = f"{kind}.{i}", f"{source}.{i}"
            rules[f"{z}.scale_shift_table"] = (f"{d}.scale_shift_table",)
            if config.norm_elementwise_affine:
                linear(f"{z}.norm1", f"{d}.norm1")
                linear(f"{z}.norm2", f"{d}.norm2")
            stacked(f"{z}.attn.qkv", [f"{d}.attn1.to_{x}" for x in "qkv"], bias)
            linear(f"{z}.attn.proj", f"{d}.attn1.to_out.0")
            if kind == "spatial" and config.cross_attention:
                linear(f"{z}.cross.q", f"{d}.attn2.to_q", bias)
                stacked(f"{z}.cross.kv", [f"{d}.attn2.to_k", f"{d}.attn2.to_v"], bias)
                linear(f"{z}.cross.proj", f"{d}.attn2.to_out.0")
            linear(f"{z}.mlp.fc1", f"{d}.ff.net.0.proj")
            linear(f"{z}.mlp.fc2", f"{d}.ff.net.2")
    rules["out_table"] = ("scale_shift_table",)
    linear("out_proj", "proj_out")
    return rules


def _listing(keys: list[str]) -> str:
    return f"{keys[:8]}" + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def convert_state_dict(
    state: dict[str, torch.Tensor], config: Latte1Config
) -> dict[str, torch.Tensor]:
    """diffusers tensors → the zoo state dict of ``Latte1(config)``.

    Raises :class:`ConversionError` listing diffusers tensors the config does not explain
    (unknown keys), tensors it needs that are absent (missing keys) and shape mismatches.
    """
    rules = name_map(config)
    needed = {name for sources in rules.values() for name in sources}
    missing = sorted(needed - set(state))
    unknown = sorted(set(state) - needed - set(RECOMPUTED))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys: {_listing(missing)}")
        if unknown:
            parts.append(f"unknown keys: {_listing(unknown)}")
        raise ConversionError(
            "the checkpoint does not match its config.json (a LatteTransformer3DModel with "
            f"num_layers={config.depth}, attention_bias={config.attention_bias}, "
            f"norm_elementwise_affine={config.norm_elementwise_affine}, cross-attention="
            f"{config.cross_attention}): " + " | ".join(parts)
        )
    out: dict[str, torch.Tensor] = {}
    for zoo, sources in rules.items():
        tensors = [state[s] for s in sources]
        if zoo == "x_embed.weight":  # Conv2d [h, C, p, p] → Linear over (row, col, channel)
            out[zoo] = tensors[0].permute(0, 2, 3, 1).reshape(tensors[0].shape[0], -1)
        else:
            out[zoo] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Latte1(config).state_dict().items()}
    wrong = [
        f"{k} ({', '.join(rules[k])}): checkpoint {tuple(out[k].shape)} vs config {tuple(s)}"
        for k, s in shapes.items()
        if out[k].shape != s
    ]
    if wrong:
        raise ConversionError(
            "checkpoint tensor shapes do not match config.json: " + "; ".join(wrong[:5])
        )
    return out


def diffusers_config(config: Latte1Config) -> dict[str, Any]:
    """The ``LatteTransformer3DModel`` config dict of ``config`` (inverse of
    :func:`latte1_config_from_diffusers`; ``num_embeds_ada_norm`` as Latte-1 has it)."""
    return {
        "_class_name": CLASS_NAME,
        "num_attention_heads": config.heads,
        "attention_head_dim": config.head_dim,
        "in_channels": config.in_channels,
        "out_channels": config.channels_out,
        "num_layers": config.depth,
        "dropout": 0.0,
        "cross_attention_dim": config.hidden if config.cross_attention else None,
        "attention_bias": config.attention_bias,
        "sample_size": config.sample_size,
        "patch_size": config.patch,
        "activation_fn": config.activation,
        "num_embeds_ada_norm": 1000,
        "norm_type": "ada_norm_single",
        "norm_elementwise_affine": config.norm_elementwise_affine,
        "norm_eps": config.norm_eps,
        "caption_channels": config.caption_channels,
        "video_length": config.video_length,
    }


def to_diffusers_state_dict(model: Latte1) -> dict[str, torch.Tensor]:
    """A ``latte1`` model's weights under diffusers' names and shapes (inverse of
    :func:`convert_state_dict`), e.g. to write a diffusers folder from a zoo model."""
    config, own = model.config, model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for zoo, sources in name_map(config).items():
        tensor = own[zoo].detach()
        if zoo == "x_embed.weight":  # Linear over (row, col, channel) → Conv2d [h, C, p, p]
            p = config.patch
            tensor = tensor.reshape(-1, p, p, config.in_channels).permute(0, 3, 1, 2)
        for name, part in zip(sources, tensor.chunk(len(sources), dim=0)):
            out[name] = part.contiguous()
    return out


# -- entry points ------------------------------------------------------------------------------
def convert_diffusers_latte(
    folder: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> Latte1:
    """Build the ``latte1`` zoo model of a diffusers ``LatteTransformer3DModel`` folder.

    ``dtype``: the parameters' dtype (default: the checkpoint's, e.g. float16 for Latte-1's
    fp16 variant; cast with ``.float()`` to run on a CPU). Returns the model in eval mode.
    """
    path = model_folder(folder)
    raw = read_config(path)
    config = latte1_config_from_diffusers(raw)
    state = convert_state_dict(load_diffusers_weights(path), config)
    if dtype is None:
        floats = {v.dtype for v in state.values() if v.is_floating_point()}
        dtype = floats.pop() if len(floats) == 1 else torch.float32
    with torch.device("meta"):
        model = Latte1(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype).eval()


def convert_folder(
    src: str | os.PathLike, dst: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> Path:
    """Convert diffusers folder ``src`` into zoo folder ``dst`` (``config.json`` +
    ``model.safetensors``, written atomically); returns ``dst``.

    ``from_pretrained(dst)`` rebuilds the model; ``load_extra(dst)`` gives the source
    diffusers config (``diffusers_config``) and where it came from.
    """
    path = model_folder(src)
    model = convert_diffusers_latte(path, dtype=dtype)
    raw = read_config(path)
    extra = {
        "converted_from": "diffusers",
        "source": str(Path(src).resolve()),
        "diffusers_config": raw,
    }
    return save_pretrained(model, dst, extra=extra)


__all__ = [
    "CLASS_NAME",
    "ConversionError",
    "convert_diffusers_latte",
    "convert_folder",
    "convert_state_dict",
    "diffusers_config",
    "latte1_config_from_diffusers",
    "load_diffusers_weights",
    "model_folder",
    "name_map",
    "read_config",
    "to_diffusers_state_dict",
]

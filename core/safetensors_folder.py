"""Reading the safetensors weights of another library's model folder.

A diffusers or transformers ``save_pretrained`` folder keeps its tensors in ``<stem>.safetensors``,
in shards listed by ``<stem>.safetensors.index.json`` (``weight_map``: tensor name → shard file),
or, for diffusers, in one variant such as ``<stem>.fp16.safetensors``. The converters
(:mod:`dspzoo.zoo.convert.diffusers_latte`, :mod:`dspzoo.domains.mamba.convert`) read them here so
a truncated file, a missing shard, two shards holding the same tensor or pickled ``.bin`` weights
fail the same way, with the file named.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import MissingFileError, UsageError


class ConversionError(UsageError):
    """A folder or state dict that is not a convertible checkpoint of the expected kind."""


def _weights_entry(folder: Path, stem: str, pickled_glob: str, variants: bool) -> Path:
    """The single weights file or the shard index to read (the plain one, else one variant)."""
    single = folder / f"{stem}.safetensors"
    index = folder / f"{stem}.safetensors.index.json"
    for entry in (single, index):
        if entry.is_file():
            return entry
    found = []
    if variants:  # e.g. diffusion_pytorch_model.fp16.safetensors (shards carry "-of-")
        found = sorted(folder.glob(f"{stem}.safetensors.index.*.json")) + [
            p for p in sorted(folder.glob(f"{stem}.*.safetensors")) if "-of-" not in p.name
        ]
    if len(found) == 1:
        return found[0]
    if found:
        raise ConversionError(
            f"{folder} has no {single.name} but several variants "
            f"{[p.name for p in found]}; keep only the one to convert"
        )
    pickled = sorted(p.name for p in folder.glob(pickled_glob))
    if pickled:
        raise ConversionError(
            f"{folder} holds pickled weights {pickled}; only safetensors are read: re-save the "
            f"model with save_pretrained(..., safe_serialization=True)"
        )
    raise MissingFileError(f"{folder} has no {single.name} (nor a sharded {index.name})")


def weight_files(
    folder: Path, stem: str, *, pickled_glob: str, variants: bool = False
) -> list[Path]:
    """The safetensors file(s) of ``folder`` holding the weights: ``[single]`` or every shard.

    Args:
        folder: the model folder.
        stem: the weights' file stem (``"model"`` for transformers, ``"diffusion_pytorch_model"``).
        pickled_glob: the pattern of the library's pickled weights, named in the error when only
            those are present (``"pytorch_model*.bin"``).
        variants: accept one ``<stem>.<variant>.safetensors`` (or its index) when the plain file
            is absent.
    """
    entry = _weights_entry(folder, stem, pickled_glob, variants)
    if entry.suffix == ".safetensors":
        return [entry]
    try:
        weight_map = json.loads(entry.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConversionError(f"{entry} is not a safetensors index (no weight_map): {exc}") from exc
    absent = [p.name for p in files if not p.is_file()]
    if absent:
        raise MissingFileError(f"{entry.name} lists shards missing from {folder}: {absent}")
    return files


def load_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` by its stored name; a tensor in two shards is an error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConversionError(f"{file} is corrupt or truncated: {exc}") from exc
        clash = sorted(set(part) & set(state))
        if clash:
            raise ConversionError(f"{file.name} repeats tensors of another shard: {clash[:5]}")
        state.update(part)
    return state

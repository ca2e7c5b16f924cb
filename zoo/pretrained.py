"""Save and load zoo models as folders: ``config.json`` + ``model.safetensors``.

Saving is atomic: the folder is written under a temporary name next to the target, its files
and the folder itself are fsynced, and only then is it renamed into place (and the parent folder
fsynced), so neither an interrupted save nor a power failure leaves a half-written checkpoint
where a good one was (a crash between the two renames of an overwrite leaves the previous
checkpoint as ``.<name>.old-*``, which loading ``<name>`` then points to). The folder and files get the usual modes under the process umask (0755 /
0644 with umask 022), like any folder the user creates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import stat
import types
import typing
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dspzoo.core.durable import fsync_path

from ..core.errors import MissingFileError, UsageError
from . import shipped
from .registry import family_info, family_of, resolve_name
from .shipped import CARD_FILE, _card_from_json, resolve_pretrained

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointMismatchError(UsageError):
    """A checkpoint does not fit the model it is loaded into."""


def _unique_sibling(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    config_name: str | None = None,
    extra: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (a registered zoo model) to folder ``path`` atomically and durably.

    ``extra``: JSON-serialisable settings that using the model needs besides its config (e.g.
    the frames, frame size and codec a video model was trained on), stored in ``config.json``
    and read back with :func:`load_extra`, so the folder is self-contained.

    ``dtype`` (e.g. ``torch.float16``) stores floating-point tensors in that precision (loading
    casts them back to the model's dtype); ``extra_files`` maps file names to text written into
    the folder before it is swapped in (e.g. a model card), so they are part of the same
    atomic save.

    ``path`` is replaced as a whole if it exists. The folder and its files are created with
    the modes the umask allows (``0o777`` / ``0o666`` masked), not private temp-file modes.
    """
    from dspzoo import __version__

    path = Path(path)
    family = family_of(model)
    config = model.config  # type: ignore[attr-defined]
    meta = {
        "dspzoo_version": __version__,
        "family": family,
        "config_name": config_name,
        "config": dataclasses.asdict(config),
        "extra": dict(extra or {}),
    }
    state = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(path, "tmp")
    tmp.mkdir(mode=0o777)  # masked by the umask, unlike tempfile.mkdtemp's 0o700
    try:
        config_file = tmp / CONFIG_FILE
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(json_safe(meta), indent=2, allow_nan=False))
            f.flush()
            os.fsync(f.fileno())
        weights = tmp / WEIGHTS_FILE
        save_file(state, str(weights), metadata={"family": family})
        # safetensors writes through a private (0600) temporary file: give the weights the
        # umask-derived mode config.json was created with
        os.chmod(weights, stat.S_IMODE(config_file.stat().st_mode))
        fsync_path(weights)
        for name, text in (extra_files or {}).items():
            if Path(name).name != name or name in (CONFIG_FILE, WEIGHTS_FILE):
                raise ValueError(
                    f"extra_files: {name!r} must be a plain file name other than "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE}"
                )
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(tmp)
        if path.exists():
            old = _unique_sibling(path, "old")
            os.replace(path, old)
            os.replace(tmp, path)
            fsync_path(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
            fsync_path(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        aside = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
        if aside:
            raise MissingFileError(
                f"checkpoint folder {path} does not exist: a save was interrupted after moving "
                f"the previous checkpoint aside to {aside[-1].name} (rename it back to "
                f"{path.name} to use it)"
            )
        raise MissingFileError(f"checkpoint folder {path} does not exist")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise MissingFileError(f"checkpoint {path} has no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        raise MissingFileError(f"checkpoint {path} has no {WEIGHTS_FILE}")
    try:
        meta = json.loads(config_file.read_text())
        meta["family"], meta["config"]  # noqa: B018 - presence check
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{config_file} is corrupt or not a dspzoo checkpoint config: {exc}"
        ) from exc
    return meta


NON_FINITE = ("Infinity", "-Infinity", "NaN")
"""How ``config.json`` spells the floats JSON has no numbers for (:func:`json_safe`)."""


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as a string of :data:`NON_FINITE`: JSON has no
    infinity or NaN (Python's ``json`` writes a bare ``Infinity`` that other readers refuse);
    :func:`_from_json` turns them back into floats for a config's float fields."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _from_json(tp: Any, value: Any) -> Any:
    """Rebuild a dataclass field value from JSON (tuples, nested dataclasses, and the
    non-finite floats :func:`json_safe` wrote as strings)."""
    origin = typing.get_origin(tp)
    if isinstance(value, str) and value in NON_FINITE and float in (tp, *typing.get_args(tp)):
        return float(value)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return _build_config(tp, value)
    if origin is tuple and isinstance(value, list):
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v) for v in value)
        return tuple(_from_json(a, v) for a, v in zip(args, value)) if args else tuple(value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is not type(None) and (
                typing.get_origin(arg) is tuple or dataclasses.is_dataclass(arg)
            ):
                return _from_json(arg, value)
    return value


def _build_config(config_cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(config_cls)
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise CheckpointMismatchError(
            f"checkpoint config has fields {unknown} that {config_cls.__name__} does not know"
        )
    return config_cls(**{k: _from_json(hints.get(k), v) for k, v in values.items()})


def load_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` settings saved with the checkpoint folder (or shipped name) ``path``."""
    return dict(_read_meta(resolve_pretrained(path)).get("extra") or {})


def load_config(path: str | os.PathLike) -> tuple[str, Any]:
    """``(family, config)`` of the checkpoint folder (or shipped name) ``path``."""
    meta = _read_meta(resolve_pretrained(path))
    fam = family_info(meta["family"])  # imports the family's module if needed
    return fam.name, _build_config(fam.config_cls, meta["config"])


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{path / WEIGHTS_FILE} is corrupt or truncated: {exc}") from exc


def load_weights(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> nn.Module:
    """Load a checkpoint folder's weights into ``model``, refusing any mismatch.

    Raises :class:`CheckpointMismatchError` listing missing and unexpected keys and shape
    mismatches (a checkpoint of another model, or of another config of the same model).
    """
    path = Path(path)
    meta = _read_meta(path)
    try:
        family = family_of(model)
    except KeyError:
        family = None
    if family is not None and family != meta["family"]:
        raise CheckpointMismatchError(
            f"checkpoint {path} is for model family {meta['family']!r}, but the model is {family!r}"
        )
    state = _load_state(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    if shapes or (strict and (missing or unexpected)):
        parts = []
        if shapes:
            parts.append(
                "shape mismatches: " + "; ".join(shapes[:10]) + (" …" if len(shapes) > 10 else "")
            )
        if strict and missing:
            parts.append(f"missing keys: {missing[:10]}")
        if strict and unexpected:
            parts.append(f"unexpected keys: {unexpected[:10]}")
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit {type(model).__name__}: " + " | ".join(parts)
        )
    model.load_state_dict(state, strict=strict)
    return model


def check_device(device: str | torch.device | None, *, flag: str | None = None) -> torch.device:
    """``device`` as a :class:`torch.device` this process can run a model on, else a
    ``ValueError`` of one line naming the device and what to use instead.

    Taken: ``cpu``, ``cuda`` / ``cuda:N`` (when this PyTorch sees that CUDA device) and ``mps``
    (when available); ``None`` is ``cpu``. ``flag`` (e.g. ``"--device"``) words the message
    for a command line (``--device cuda: ...; use --device cpu``) rather than for a call
    (``device='cuda': ...; use device='cpu'``). The one check behind ``from_pretrained``,
    :func:`dspzoo.zoo.inference.load` and the inference commands' ``--device``.
    """
    if device is None:
        return torch.device("cpu")
    shown = f"{flag} {device}" if flag else f"device={str(device)!r}"

    def use(name: str) -> str:
        return f"use {flag} {name}" if flag else f"use device={name!r}"

    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    best = "cuda" if cuda else "mps" if mps else "cpu"
    here = ["cpu", *(["cuda", "cuda:N"] if cuda else []), *(["mps"] if mps else [])]
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(
            f"{shown}: not a device a dspzoo model runs on (this machine has "
            f"{', '.join(here)}); {use(best)}"
        )
    if dev.type == "cuda" and not cuda:
        built = torch.version.cuda is not None or torch.version.hip is not None
        why = "no GPU is visible to it" if built else "it is built without CUDA"
        raise UsageError(
            f"{shown}: this PyTorch has no CUDA device (torch.cuda.is_available() is False: "
            f"{why}); {use(best)}"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UsageError(
            f"{shown}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
            f"{use('cuda:0')}"
        )
    if dev.type == "mps" and not mps:
        raise UsageError(
            f"{shown}: this PyTorch has no MPS device (torch.backends.mps.is_available() is "
            f"False); {use(best)}"
        )
    if dev.type == "mps" and dev.index not in (None, 0):
        raise UsageError(f"{shown}: there is one MPS device, mps:0; {use('mps')}")
    return dev


def from_pretrained(
    path: str | os.PathLike,
    *,
    expected_family: str | None = None,
    device: str | torch.device = "cpu",
    strict: bool = True,
) -> nn.Module:
    """Rebuild a zoo model from a folder written by :func:`save_pretrained`.

    ``path`` may also be the name of a model shipped with the package (``dspzoo list
    --pretrained``), e.g. ``"stdit-mini-shapes"``.

    ``expected_family`` (e.g. ``"bytelm"``) refuses another family's checkpoint with a
    :class:`CheckpointMismatchError` before anything is built.

    The model is returned in **eval mode** (this is an inference entry point: dropout off,
    whatever the family); call ``model.train()`` to train it further (the Trainer does, e.g.
    for ``--init-from``). :func:`~dspzoo.zoo.create_model` returns a fresh model in training
    mode.

    ``device``: where the model goes (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``); one that
    is not a device or that this machine lacks raises a ``ValueError`` (:func:`check_device`)
    before anything is read.
    """
    device = check_device(device)
    path = resolve_pretrained(path)
    saved = _read_meta(path)["family"]
    if expected_family is not None and saved != expected_family:
        raise CheckpointMismatchError(
            f"checkpoint {path} is for model family {saved!r}, but {expected_family!r} was expected"
        )
    family, config = load_config(path)
    model = family_info(family).model_cls(config)
    load_weights(model, path, strict=strict)
    return model.to(device).eval()


def ship_pretrained(
    model: nn.Module,
    name: str,
    *,
    config_name: str,
    extra: dict[str, Any] | None = None,
    card: dict[str, Any],
    dtype: torch.dtype | None = torch.float16,
    root: str | os.PathLike | None = None,
) -> Path:
    """Write ``model`` as shipped model ``name`` into ``zoo/weights/`` (or ``root``), atomically.

    ``config_name`` is the zoo config the model instantiates (``"evoformer-small"``), and
    ``name`` must extend it with the data it was trained on (``"evoformer-small-pdb"``).
    ``card`` needs the keys ``model``, ``data``, ``metrics``, ``command`` and ``eval`` (see
    :class:`ModelCard`); ``dtype`` stores the floating-point weights in that precision
    (``None``: as they are).
    """
    config_name = resolve_name(config_name)
    family = family_of(model)
    if not config_name.startswith(f"{family}-"):
        raise ValueError(f"config {config_name!r} is not of the model's family {family!r}")
    if not name.casefold().startswith(config_name.casefold() + "-") or name.casefold() == (
        config_name.casefold()
    ):
        raise ValueError(
            f"shipped names look like '<family>-<config>-<data>': {name!r} must start with "
            f"'{config_name}-' and name the data after it"
        )
    card = dict(card)
    card.setdefault("model", config_name)
    card["parameters"] = sum(p.numel() for p in model.parameters())
    _card_from_json(name, card)  # validates the keys
    # WEIGHTS_DIR is looked up at call time (tests point it elsewhere)
    return save_pretrained(
        model,
        Path(root or shipped.WEIGHTS_DIR) / name,
        config_name=config_name,
        extra=extra,
        dtype=dtype,
        extra_files={CARD_FILE: json.dumps(card, indent=2) + "\n"},
    )

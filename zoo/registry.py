"""Model registry: families (a model class + its config dataclass) and their named configs.

A zoo model is constructed as ``ModelCls(config)`` and keeps ``self.config``. Full model names
are ``"<family>-<config>"``, e.g. ``"stdit-tiny"`` or ``"stdit-720M"``. Lookups ignore case
(``"stdit-720m"`` finds ``"stdit-720M"``), so names that differ only in case cannot both be
registered; :func:`resolve_name` gives the registered spelling.

Every lookup sees every family: a name not registered yet makes the registry import the family
modules (:mod:`~dspzoo.zoo.families`) and look again: dspzoo's domains first, then the
installed ``dspzoo.families`` entry points and ``DSPZOO_FAMILIES`` (so a broken plugin does not
stop a built-in model from loading; :func:`list_models` imports them all).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.argparser import suggestion
from ..core.errors import UnknownNameError, UsageError
from .families import (
    BUILTIN_WHERE,
    HOW_TO_REGISTER,
    FamilyClashError,
    builtin_modules,
    how_to_drop,
    importing,
    load_builtin_families,
    load_families,
)


@dataclass
class Family:
    """A registered model family."""

    name: str
    model_cls: type[nn.Module]
    config_cls: type
    configs: dict[str, Any] = field(default_factory=dict)
    origin: str = ""
    """Who registered it (:func:`registered_by`), for the error of a second registration."""
    drop: str = ""
    """How to stop that module registering it (:func:`~dspzoo.zoo.families.how_to_drop`)."""


_FAMILIES: dict[str, Family] = {}


def registered_by(module: str) -> tuple[str, str]:
    """``(origin, how to drop it)`` of a registration made by ``module``: the module, and the
    entry point or ``DSPZOO_FAMILIES`` that had it imported (:func:`~dspzoo.zoo.families.importing`);
    a module imported otherwise (a script's own import) is named alone; one of dspzoo's
    domains is built-in however it was imported."""
    current = importing()
    if current is None and any(
        module.startswith(f"{b}.") or module == b for b in builtin_modules()
    ):
        current = (module, BUILTIN_WHERE)
    if current is None:
        return f"module {module!r}", how_to_drop(module, None)
    imported, where = current
    if where == BUILTIN_WHERE:
        return f"dspzoo's built-in module {module!r}", how_to_drop(module, where)
    via = "" if imported == module else f"imported by {imported!r}, "
    return f"module {module!r} ({via}named by {where})", how_to_drop(imported, where)


def register_family(family: str, model_cls: type[nn.Module], config_cls: type) -> None:
    """Register ``model_cls`` (built as ``model_cls(config)``) under ``family``."""
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(
            f"config class of family {family!r} must be a dataclass, got {config_cls!r}"
        )
    if "-" in family:
        raise ValueError(f"family names may not contain '-': {family!r}")
    # the module calling register_family (a helper of its own may call it: then that one's)
    origin, drop = registered_by(sys._getframe(1).f_globals.get("__name__", "?"))
    clash = _match(family, _FAMILIES)
    if clash is not None:
        first = _FAMILIES[clash]
        spelled = f" (as {clash!r}; names ignore case)" if clash != family else ""
        if not first.drop or not drop:  # one is dspzoo's own: the other one gives way
            yours = first.drop or drop
            fix = "A built-in family keeps its name: give yours another one" + (
                f", or {yours}" if yours else ""
            )
        else:
            fixes = [first.drop, drop] if first.drop != drop else [drop]
            fix = f"Keep one of the two: {', or '.join(fixes)}"
        raise FamilyClashError(
            f"model family {family!r} is already registered{spelled}, by "
            f"{first.origin or 'dspzoo'}; {origin} registers it again. {fix}"
        )
    _FAMILIES[family] = Family(family, model_cls, config_cls, origin=origin, drop=drop)


def register_config(family: str, name: str, config: Any) -> None:
    """Register a named config (an instance of the family's config dataclass)."""
    fam = _family(family)
    if not isinstance(config, fam.config_cls):
        raise TypeError(
            f"config {name!r} of family {family!r} must be a {fam.config_cls.__name__}, got {type(config).__name__}"
        )
    clash = _match(name, fam.configs)
    if clash is not None:
        raise ValueError(
            f"config {fam.name}-{name} is already registered"
            + (f" (as {fam.name}-{clash}; names ignore case)" if clash != name else "")
        )
    fam.configs[name] = config


def unregister_family(family: str) -> None:
    """Remove a family and its configs (for tests and interactive use)."""
    _FAMILIES.pop(family, None)


def _match(name: str, known: Any) -> str | None:
    """The key of ``known`` equal to ``name`` ignoring case (exact spelling first), or None."""
    if name in known:
        return name
    folded = name.casefold()
    for key in known:
        if key.casefold() == folded:
            return key
    return None


def _close(name: str, known: list[str]) -> list[str]:
    """Registered names that look like ``name`` (compared ignoring case), best first."""
    by_folded = {k.casefold(): k for k in known}
    close = difflib.get_close_matches(name.casefold(), list(by_folded), n=3)
    return [by_folded[c] for c in close]


def _family(family: str) -> Family:
    key = _match(family, _FAMILIES)
    for load in (load_builtin_families, load_families):  # not imported yet: built-in, plugin
        if key is not None:
            break
        load()
        key = _match(family, _FAMILIES)
    if key is not None:
        return _FAMILIES[key]
    hint = suggestion(_close(family, list(_FAMILIES)))
    raise UnknownNameError(
        f"unknown model family {family!r}{hint} (registered: {', '.join(sorted(_FAMILIES))}); "
        + HOW_TO_REGISTER
    )


def family_of(model: nn.Module) -> str:
    """The family name under which ``type(model)`` is registered."""
    for load in (load_builtin_families, load_families, None):
        for fam in _FAMILIES.values():
            if type(model) is fam.model_cls:
                return fam.name
        if load is not None:
            load()
    raise UnknownNameError(f"{type(model).__name__} is not a registered zoo model class")


def family_info(family: str) -> Family:
    """The :class:`Family` record for ``family``."""
    return _family(family)


def list_models(family: str | None = None) -> list[str]:
    """All ``family-config`` names, optionally of one family."""
    if family is None:
        load_families()
    fams = [_family(family)] if family else list(_FAMILIES.values())
    return sorted(f"{f.name}-{c}" for f in fams for c in f.configs)


def split_name(name: str) -> tuple[str, str]:
    """``"stdit-720M"`` → ``("stdit", "720M")`` (as written; see :func:`resolve_name`)."""
    family, sep, config = name.partition("-")
    if not sep or not config:
        fam = _match(family, _FAMILIES)
        close = list_models(fam) if fam is not None else _close(name, list_models())
        raise UsageError(
            f"model names look like 'family-config' (e.g. 'stdit-tiny'), got {name!r}"
            f"{suggestion(close)} (known: {', '.join(list_models())})"
        )
    return family, config


def resolve_name(name: str) -> str:
    """The registered spelling of model ``name`` (``"stdit-720m"`` → ``"stdit-720M"``).

    Raises ``ValueError`` for a name without ``-`` and ``KeyError`` for an unknown family or
    config, each with a did-you-mean hint.
    """
    family, config = split_name(name)
    fam = _family(family)
    key = _match(config, fam.configs)
    if key is None:
        known = list_models(fam.name)
        hint = suggestion(_close(name, known))
        raise UnknownNameError(f"unknown model {name!r}{hint} (known: {', '.join(known)})")
    return f"{fam.name}-{key}"


def get_config(name: str) -> Any:
    """The registered config of ``name`` (case-insensitive)."""
    family, config = resolve_name(name).split("-", 1)
    return _FAMILIES[family].configs[config]


def override_config(config: Any, **overrides: Any) -> Any:
    """``dataclasses.replace`` with a clear error for unknown fields."""
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise UsageError(
            f"unknown config field(s) {unknown} for {type(config).__name__}; valid fields: {sorted(names)}"
        )
    return dataclasses.replace(config, **overrides)


def create_model(
    name: str, *, device: str | torch.device | None = None, **overrides: Any
) -> nn.Module:
    """Build the zoo model ``name`` with config ``overrides``.

    ``name`` ignores case. ``device="meta"`` builds it without allocating memory (to count
    parameters of the big configs).
    """
    name = resolve_name(name)
    config = override_config(get_config(name), **overrides)
    cls = _family(split_name(name)[0]).model_cls
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())


def format_count(n: int) -> str:
    """``1234567`` → ``"1.2M"``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)

"""Where model families come from: dspzoo's domains, installed packages and ``DSPZOO_FAMILIES``.

A family exists once the module that calls :func:`~dspzoo.zoo.registry.register_family` for
it has been imported. This module finds those modules and imports them:

* **built-in** — dspzoo's own domains (:data:`BUILTIN_MODULES`);
* **installed packages** — every entry point of the packaging group ``dspzoo.families``
  (:data:`ENTRY_POINT_GROUP`) names a module, e.g. in the package's ``pyproject.toml``::

      [project.entry-points."dspzoo.families"]
      mymodels = "mymodels.zoo"

* **scripts** — the environment variable ``DSPZOO_FAMILIES`` (:data:`ENV_VAR`), a
  comma-separated list of importable module names, e.g. ``DSPZOO_FAMILIES=my_model``.

Nothing is imported when ``dspzoo.zoo`` is: the registry calls :func:`load_families` the first
time a lookup misses (an unknown family or model name, ``list_models()``), so every entry
point — ``create_model``, ``from_pretrained``, ``get_config``, ``dspzoo list/info/plan`` —
sees every family. This module imports nothing of dspzoo: the registry imports it, and the
modules it imports import the registry.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points

from ..core.errors import UsageError

BUILTIN_MODULES = (
    "dspzoo.domains.toy",
    "dspzoo.domains.video",
    "dspzoo.domains.text",
    "dspzoo.domains.protein",
    "dspzoo.domains.weather",
    "dspzoo.domains.mamba",
    "dspzoo.examples.axial3d",
)
ENTRY_POINT_GROUP = "dspzoo.families"
ENV_VAR = "DSPZOO_FAMILIES"
HOW_TO_REGISTER = (
    f"a family outside dspzoo registers through the {ENTRY_POINT_GROUP!r} entry point of its "
    f"package or {ENV_VAR}=<module>[,<module>...] (docs/new_architecture.md, 'Registering your "
    f"family outside dspzoo')"
)


BUILTIN_WHERE = "dspzoo's built-in domains (BUILTIN_MODULES of zoo/families.py)"


class FamilyImportError(UsageError, ImportError):
    """A module named by an entry point or ``DSPZOO_FAMILIES`` failed to import: bad input
    (a :class:`~dspzoo.core.entry.UsageError`), so a script run by ``run_entry_point`` or a
    training script's flags say it in one line, once per launch, status 2."""


class FamilyClashError(UsageError):
    """A family name registered twice (by the registry; its message names both sources)."""


_builtins_loaded = False
_loading = False  # re-entry guard: the imported modules call the registry while we import them
_entry_points: list[tuple[str, str]] | None = None
#: ``(module, where)`` of the family modules being imported now, the innermost last
_importing: list[tuple[str, str]] = []


def importing() -> tuple[str, str] | None:
    """``(module, where)`` of the family module this module is importing now (``where`` as
    :func:`entry_point_modules` and :func:`env_modules` say it, or :data:`BUILTIN_WHERE`), so
    that the registry can say where a family came from; ``None`` outside such an import."""
    return _importing[-1] if _importing else None


def how_to_drop(module: str, where: str | None) -> str:
    """How to stop ``module``, imported for ``where`` (:func:`importing`), registering its
    families: a ``DSPZOO_FAMILIES`` module, an entry point, or a module imported directly
    (``""`` for dspzoo's own: a built-in family keeps its name)."""
    if where is None:
        return f"stop importing {module!r} (or its register_family call)"
    if where == BUILTIN_WHERE:
        return ""
    if where.startswith(ENV_VAR):
        return f"take {module!r} out of {ENV_VAR}"
    return (
        f"remove the {ENTRY_POINT_GROUP!r} entry point naming {module!r} (or uninstall its package)"
    )


def builtin_modules() -> tuple[str, ...]:
    """The modules of dspzoo's own domains, in import order."""
    return BUILTIN_MODULES


def entry_point_modules() -> list[tuple[str, str]]:
    """``(module, where)`` of every installed ``dspzoo.families`` entry point (scanned once)."""
    global _entry_points
    if _entry_points is None:
        found = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            owner = f" of the installed package {dist.name} {dist.version}" if dist else ""
            found.append((ep.module, f"the {ENTRY_POINT_GROUP!r} entry point {ep.name!r}{owner}"))
        _entry_points = found
    return list(_entry_points)


def env_modules() -> list[tuple[str, str]]:
    """``(module, where)`` of every module named by ``DSPZOO_FAMILIES`` (read on every call)."""
    names = [n.strip() for n in os.environ.get(ENV_VAR, "").split(",")]
    return [(n, f"{ENV_VAR}={os.environ[ENV_VAR]!r}") for n in names if n]


def _import_builtin(name: str) -> None:
    _importing.append((name, BUILTIN_WHERE))
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:  # a domain that exists but fails to import is a real error
            raise
    finally:
        _importing.pop()


def _import_plugin(name: str, where: str) -> None:
    _importing.append((name, where))
    try:
        importlib.import_module(name)
    except FamilyClashError as exc:  # its message names both modules and the fix already
        raise FamilyImportError(str(exc)) from exc
    except Exception as exc:
        raise FamilyImportError(
            f"cannot import module {name!r}, named by {where}, to register its model families: "
            f"{type(exc).__name__}: {exc}. Fix or uninstall that package, or correct {ENV_VAR}"
        ) from exc
    finally:
        _importing.pop()


def load_builtin_families() -> None:
    """Import dspzoo's domains (once), registering the built-in families."""
    global _builtins_loaded, _loading
    if _builtins_loaded or _loading:
        return
    _loading = True
    try:
        for name in builtin_modules():
            _import_builtin(name)
        _builtins_loaded = True
    finally:
        _loading = False


def load_families() -> None:
    """Import every family module: the built-ins, then installed entry points, then
    ``DSPZOO_FAMILIES``. Modules already imported cost nothing; a plugin module that fails to
    import raises :class:`FamilyImportError` naming it and where it was declared."""
    global _loading
    if _loading:
        return
    load_builtin_families()
    _loading = True
    try:
        for name, where in entry_point_modules() + env_modules():
            _import_plugin(name, where)
    finally:
        _loading = False

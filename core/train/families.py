"""Which model families a training task trains, checked before a run sets anything up.

Every :class:`~dspzoo.core.train.task.Task` declares the families it trains
(:attr:`Task.families`). :func:`check_trains` looks up the model a run would train — ``--model``
(an unknown name gets the zoo's did-you-mean error) or the family saved with
``--init-from``'s weights — and refuses a model of another family with one line that names the
family, what the task trains and the ``dspzoo train`` domain that trains it::

    --model 'mambalm-tiny' is a mambalm model; dspzoo train text trains bytelm models (e.g.
    bytelm-tiny, bytelm-small); for mambalm use dspzoo train mamba

The training scripts call it while parsing their flags (:class:`~dspzoo.core.train.flags.
TrainingCLI`: one line, status 2, printed once per launch, before any process group exists),
and the :class:`~dspzoo.core.train.trainer.Trainer` calls it again before it builds the mesh or
writes to the output folder, for runs started from Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .config import _default_model

if TYPE_CHECKING:
    from .task import Task

UNKNOWN = "?"
"""What :func:`training_domains` lists for a domain whose script could not be imported."""

EXAMPLES = 4
"""How many model names the refusal offers as examples of what the task trains."""


def model_family(cfg: Any) -> tuple[str, str]:
    """``(family, how the user gave it)`` of the model ``cfg`` trains.

    ``cfg.model`` is the zoo config the run builds: ``--model``, or the one ``--init-from``'s
    weights were saved as (the run config puts it there, :func:`~.config.model_of_weights`).
    Raises the zoo's ``KeyError`` / ``ValueError`` (with its did-you-mean hint) for an unknown
    model name.
    """
    from dspzoo.zoo.registry import resolve_name, split_name

    family = split_name(resolve_name(cfg.model))[0]
    if getattr(cfg, "init_from", None):
        return family, f"--init-from {cfg.init_from!r} holds {_a(family)} model"
    return family, f"--model {cfg.model!r} is {_a(family)} model"


def _a(word: str) -> str:
    """``word`` with its indefinite article (``a stdit``, ``an evoformer``)."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def training_domains() -> dict[str, tuple[str, ...]]:
    """The families each ``dspzoo train <domain>`` trains, by domain (the domains of
    :data:`dspzoo.zoo.run_cli.COMMANDS`; a script that cannot be imported is left out)."""
    from dspzoo.zoo.run_cli import COMMANDS

    domains: dict[str, tuple[str, ...]] = {}
    for domain, module in COMMANDS["train"].scripts.items():
        try:
            script = importlib.import_module(f"dspzoo.scripts.{module}")
        except ImportError:  # its optional dependencies are missing: the hint says so
            domains[domain] = (UNKNOWN,)
            continue
        task = getattr(getattr(script, "CLI", None), "task", None)
        if task is not None:
            domains[domain] = tuple(task.families)
    return domains


def _command(task_cls: type[Task], domains: dict[str, tuple[str, ...]]) -> str:
    """How the refusal names ``task_cls``: its ``dspzoo train`` command, or the task."""
    if domains.get(task_cls.name) == tuple(task_cls.families):
        return f"dspzoo train {task_cls.name}"
    return f"the {task_cls.name} task"


def _examples(task_cls: type[Task], default: str) -> list[str]:
    """A few registered names the task trains: each family's ``-tiny`` model, then the
    task's default model."""
    from dspzoo.zoo.registry import list_models

    names: list[str] = []
    for family in task_cls.families:
        try:
            known = list_models(family)
        except KeyError:  # a family whose module is not installed
            continue
        tiny = [n for n in known if n.casefold() == f"{family}-tiny".casefold()]
        names += tiny or known[:1]
    if default and default not in names:
        names.append(default)
    return names[:EXAMPLES]


def refusal(task_cls: type[Task], family: str, given: str, default: str = "") -> str:
    """The one-line message refusing a ``family`` model for ``task_cls`` (``given``: how the
    user named the model; ``default``: the task's default model, offered as an example)."""
    domains = training_domains()
    trains = ", ".join(task_cls.families)
    examples = _examples(task_cls, default)
    example = f" (e.g. {', '.join(examples)})" if examples else ""
    elsewhere = [d for d, fams in domains.items() if family.casefold() in _folded(fams)]
    unknown = sorted(d for d, fams in domains.items() if fams == (UNKNOWN,))
    if elsewhere:
        where = " or ".join(f"dspzoo train {d}" for d in elsewhere)
        hint = f"for {family} use {where}"
    elif unknown:  # one of these may train it: say they could not be asked
        hint = (
            f"no `dspzoo train` domain that imports here trains {family} models (could not "
            f"import the training scripts of {', '.join(unknown)})"
        )
    else:
        hint = f"no `dspzoo train` domain trains {family} models"
    return f"{given}; {_command(task_cls, domains)} trains {trains} models{example}; {hint}"


def _folded(families: tuple[str, ...]) -> set[str]:
    return {f.casefold() for f in families}


def check_trains(task_cls: type[Task], cfg: Any) -> None:
    """Refuse (``UsageError``) a model of a family ``task_cls`` does not train.

    Cheap and local: it reads the model registry, builds nothing and needs no process group. A task that declares no families is not
    checked (it may build its model without the zoo).
    """
    if not task_cls.families:
        return
    family, given = model_family(cfg)
    if family.casefold() not in _folded(task_cls.families):
        raise UsageError(refusal(task_cls, family, given, _default_model(cfg)))

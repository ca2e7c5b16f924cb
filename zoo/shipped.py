"""Trained models shipped inside the package, loadable by name.

Each lives in ``zoo/weights/<name>/``: the :func:`~dspzoo.zoo.pretrained.save_pretrained` folder
(``config.json`` with the settings using it needs in ``extra``, ``model.safetensors``, often in
fp16) plus ``card.json``, the model card: what it was trained on, its evaluation figures, the
exact command that trained it and how to recompute the figures.

Names are ``<family>-<config>-<data>``, e.g. ``stdit-mini-shapes`` or ``evoformer-small-pdb``;
they ignore case. ``from_pretrained("stdit-mini-shapes")`` loads one;
``dspzoo list --pretrained`` lists them fitted to the terminal, ``--markdown`` prints the table
(also ``docs/zoo.md``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.argparser import suggestion
from ..core.errors import MissingFileError, UsageError
from .registry import _close, _match

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
CARD_FILE = "card.json"
CARD_KEYS = ("model", "data", "metrics", "command", "eval")


@dataclass(frozen=True)
class ModelCard:
    """What a shipped model is: the card stored beside its weights.

    Attributes:
        name: the shipped name, ``<family>-<config>-<data>``.
        model: the zoo config it instantiates, e.g. ``"stdit-mini"``.
        data: what it was trained on.
        metrics: evaluation figures, name → value (recomputed by ``eval``).
        command: the exact command that trained it.
        eval: the function or command that recomputes ``metrics``.
        notes: anything a user should know (limits, training time).
        parameters: parameter count.
    """

    name: str
    model: str
    data: str
    metrics: dict[str, float]
    command: str
    eval: str
    notes: str = ""
    parameters: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _card_from_json(name: str, raw: dict[str, Any]) -> ModelCard:
    known = {f for f in ModelCard.__dataclass_fields__ if f not in ("name", "extra")}
    missing = [k for k in CARD_KEYS if k not in raw]
    if missing:
        raise UsageError(f"model card of {name!r} lacks {missing}")
    return ModelCard(
        name=name,
        **{k: raw[k] for k in known if k in raw},
        extra={k: v for k, v in raw.items() if k not in known},
    )


def shipped_names() -> list[str]:
    """Names of the models shipped with the package, sorted."""
    if not WEIGHTS_DIR.is_dir():
        return []
    return sorted(p.name for p in WEIGHTS_DIR.iterdir() if (p / CARD_FILE).is_file())


def pretrained_path(name: str) -> Path:
    """The folder of shipped model ``name`` (case-insensitive).

    Raises ``FileNotFoundError`` naming the shipped models when there is none of that name.
    """
    names = shipped_names()
    key = _match(name, names)
    if key is None:
        hint = suggestion(_close(name, names))
        raise MissingFileError(
            f"no checkpoint folder or shipped weights named {name!r}{hint or '.'} Shipped models: "
            f"{', '.join(names) or 'none'} "
            f"(`dspzoo list --pretrained`); a zoo config name such as 'stdit-mini' builds an "
            f"untrained model with create_model(), and a folder written by save_pretrained "
            f"loads with from_pretrained(<folder>)"
        )
    return WEIGHTS_DIR / key


def resolve_pretrained(path: str | os.PathLike) -> Path:
    """A checkpoint folder as given, or the folder of the shipped model of that name.

    A single path component that is not an existing folder is looked up among the shipped
    names (an unknown one raises ``FileNotFoundError`` listing them).
    """
    as_path = Path(path)
    if as_path.exists() or len(as_path.parts) != 1:
        return as_path
    return pretrained_path(as_path.name)


def model_card(name: str) -> ModelCard:
    """The card of shipped model ``name``."""
    folder = pretrained_path(name)
    return _card_from_json(folder.name, json.loads((folder / CARD_FILE).read_text()))


def list_pretrained() -> list[ModelCard]:
    """Cards of every shipped model."""
    return [model_card(n) for n in shipped_names()]


def round_to_shipped_precision(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """Round ``model``'s floating-point weights and buffers to ``dtype`` in place, keeping its
    own dtype: the model as :func:`~dspzoo.zoo.pretrained.ship_pretrained` will store it, so figures measured on it
    are the figures of the shipped copy. Returns ``model``."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))
    return model


def _metric_text(metrics: dict[str, float], limit: int | None = None) -> str:
    items = list(metrics.items())
    shown = items[:limit] if limit else items
    text = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown)
    return text + (
        f", … ({len(items) - len(shown)} more: `dspzoo info`)" if len(shown) < len(items) else ""
    )


def pretrained_table(cards: list[ModelCard] | None = None) -> str:
    """A markdown table of the shipped models (``dspzoo list --pretrained --markdown``,
    ``docs/zoo.md``)."""
    cards = list_pretrained() if cards is None else cards
    if not cards:
        return "no trained models are shipped with this install"
    rows = [
        "| name | model | parameters | trained on | metrics | trained with |",
        "|---|---|---|---|---|---|",
    ]
    from .registry import format_count

    for c in cards:
        rows.append(
            f"| `{c.name}` | {c.model} | {format_count(c.parameters)} | {c.data} | "
            f"{_metric_text(c.metrics, limit=3)} | `{c.command}` |"
        )
    return "\n".join(rows)


def _fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters, the cut marked with ``…``."""
    return line if len(line) <= width else line[: max(0, width - 1)] + "…"


def pretrained_listing(cards: list[ModelCard] | None = None, width: int | None = None) -> str:
    """The shipped models for a terminal ``width`` columns wide (``dspzoo list --pretrained``;
    default: the terminal's width, ``shutil.get_terminal_size``: ``$COLUMNS``, else 80 when
    the output is not a terminal).

    Per model a line with its name, config and parameters (cut with ``…`` only when the
    terminal is narrower than they are), then its training data and first three metrics,
    each wrapped to ``width`` beneath it; no line is longer than ``width``. Every metric and
    the training command: ``dspzoo info <name>``; the whole table: :func:`pretrained_table`.
    """
    import shutil
    import textwrap

    from .registry import format_count

    width = max(20, shutil.get_terminal_size().columns if width is None else width)
    cards = list_pretrained() if cards is None else cards
    if not cards:
        return "no trained models are shipped with this install"
    name_w = max(len(c.name) for c in cards)
    model_w = max(len(c.model) for c in cards)
    lines: list[str] = []

    def wrapped(label: str, text: str) -> list[str]:
        return textwrap.wrap(
            f"{label} {text}",
            width,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,  # model names stay whole
        )

    for c in cards:
        params = f"{format_count(c.parameters):>7} params"
        aligned = f"{c.name:<{name_w}}  {c.model:<{model_w}}  {params}"
        if len(aligned) <= width:
            lines.append(aligned)
        else:  # too narrow for the columns: the name alone, the model and its size beneath
            lines.append(_fit(c.name, width))
            lines += wrapped("model:", f"{c.model}, {format_count(c.parameters)} parameters")
        lines += wrapped("trained on:", c.data)
        lines += wrapped("metrics:", _metric_text(c.metrics, limit=3).replace("`", ""))
    footer = (
        "Every metric, the training command and the evaluation: dspzoo info <name>; the "
        "markdown table of docs/zoo.md: dspzoo list --pretrained --markdown."
    )
    return "\n".join([*lines, "", *textwrap.wrap(footer, width)])


def describe_card(card: ModelCard) -> str:
    """A model card as text (``dspzoo info <shipped-name>``)."""
    from .registry import format_count

    lines = [
        f"{card.name}: trained {card.model} ({format_count(card.parameters)} parameters)",
        f"  data     {card.data}",
        f"  metrics  {_metric_text(card.metrics)}",
        f"  command  {card.command}",
        f"  eval     {card.eval}",
        f"  folder   {pretrained_path(card.name)}",
    ]
    if card.notes:
        lines.append(f"  notes    {card.notes}")
    return "\n".join(lines)

"""Dataclass configs whose fields are command-line flags, with descriptions and choices.

A training config is a dataclass; each field made with :func:`flag` carries its help text
and, optionally, its allowed values. :func:`build_parser` turns the dataclass into an
``argparse`` parser (``--field-name``, typed, with choices) and :func:`check_values` gives the
clear errors argparse cannot (ranges).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..argparser import CommandParser, flag_given
from ..errors import UsageError

if TYPE_CHECKING:
    from .task import Task

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A config field that is also a command-line flag with a description and choices."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def parse_bool(text: str) -> bool:
    """``true/false/yes/no/on/off/1/0`` → bool (argparse ``type``)."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def check_values(cfg: Any, positive: Iterable[str] = (), non_negative: Iterable[str] = ()) -> None:
    """Raise a clear ``ValueError`` for a field outside its choices or range."""
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise UsageError(
                f"{_option(f.name)} must be one of {list(choices)}, got {getattr(cfg, f.name)!r}"
            )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UsageError(f"{_option(name)} must be >= 1, got {getattr(cfg, name)}")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise UsageError(f"{_option(name)} must be >= 0, got {getattr(cfg, name)}")


def build_parser(
    config_cls: type, description: str | None, defaults_shown: dict[str, str] | None = None
) -> argparse.ArgumentParser:
    """One flag per field of ``config_cls``, with its description, type and choices.

    ``defaults_shown`` overrides how a default is described (e.g. ``outputs/<model>``).
    """
    parser = CommandParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(config_cls)
    shown = defaults_shown or {}
    for f in dataclasses.fields(config_cls):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        choices = f.metadata.get("choices")
        default = (
            "optional"
            if f.default is None
            else f"default: {'none' if f.default == '' else f.default}"
        )
        default = shown.get(f.name, default)
        description = f.metadata.get("help", "")
        if "(default" not in description:  # a help that says its default says it once
            description = f"{description} ({default})"
        switch = {"nargs": "?", "const": True} if base is bool else {}  # bare --fsdp: true
        parser.add_argument(
            _option(f.name),
            type=parse_bool if base is bool else base,
            default=f.default,
            choices=choices,
            metavar="{true,false}" if base is bool else (None if choices else f.name.upper()),
            help=description,
            **switch,
        )
    return parser


def parse_config(
    config_cls: type,
    argv: list[str] | None,
    description: str | None,
    defaults_shown: dict[str, str] | None = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """Parse ``argv`` into a validated ``config_cls`` (its ``validate()``, then ``check(cfg)``
    if given). Bad input — in the flags, in building the config (``--init-from``'s weights),
    in validating or checking it — is the parser's one-line error, printed once per launch,
    and exits 2."""
    from ..entry import USER_ERRORS, error_message

    parser = build_parser(config_cls, description, defaults_shown)
    args = parser.parse_args(argv)
    try:
        words = sys.argv[1:] if argv is None else argv
        if getattr(args, "init_from", None) and flag_given("--model", words):
            # an explicit --model must match --init-from's weights even when it is the
            # script's default name (the config alone cannot tell it from no flag)
            from .config import model_of_weights

            model_of_weights(args.init_from, args.model)
        cfg = config_cls(**vars(args))
        cfg.validate()
        if check is not None:
            check(cfg)
    except USER_ERRORS as exc:
        parser.error(error_message(exc))
    return cfg


class TrainingCLI:
    """The command line of a training script: flags from ``config_cls``, then ``train``.

    ``train(cfg)`` returns ``{"is_main", "losses", "output_dir", …}``; ``loss_name`` names the
    losses in the closing log line. ``task``, the domain's :class:`~dspzoo.core.train.task.Task`
    class, checks the model while the flags are parsed (:meth:`Task.check_model`: a model of
    another family is one line, status 2, before any process group or output folder exists),
    and tells ``dspzoo train`` which families the domain trains.
    """

    SHOWN_DEFAULTS = {"output_dir": "default: outputs/<model>"}

    def __init__(
        self,
        config_cls: type,
        train: Any,
        description: str | None,
        logger_name: str,
        loss_name: str = "losses",
        task: type[Task] | None = None,
    ) -> None:
        self.config_cls, self.train, self.description = config_cls, train, description
        self.logger_name, self.loss_name, self.task = logger_name, loss_name, task

    def build_parser(self) -> argparse.ArgumentParser:
        """One flag per config field, with its description and choices."""
        return build_parser(self.config_cls, self.description, self.SHOWN_DEFAULTS)

    def parse_args(self, argv: list[str] | None = None) -> Any:
        """A validated config from ``--field-name value`` flags (errors exit 2)."""
        check = self.task.check_model if self.task is not None else None
        return parse_config(
            self.config_cls, argv, self.description, self.SHOWN_DEFAULTS, check=check
        )

    def main(self, argv: list[str] | None = None) -> None:
        """Parse, train, and log the session's first and last loss."""
        import logging

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
        result = self.train(self.parse_args(argv))
        if result["is_main"] and result["losses"]:
            logging.getLogger(self.logger_name).info(
                "session %s: first step %.4f, last step %.4f (one step each; the progress "
                "bar shows a running mean); output in %s",
                self.loss_name,
                result["losses"][0],
                result["losses"][-1],
                result["output_dir"],
            )

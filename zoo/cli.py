"""``dspzoo`` command line: the zoo, its shipped models, and every domain's scripts.

dspzoo list                  # every model config with its parameter count
dspzoo list --pretrained     # the trained models shipped with the package
dspzoo info stdit-720M       # names ignore case: stdit-720m works too
dspzoo plan | bench ...      # cost model, benchmark (docs/cost_model.md, docs/benchmark.md)
dspzoo train <domain> ...    # video, text, protein, weather, mamba (see zoo/run_cli.py)
dspzoo sample|generate|predict|forecast <shipped-name-or-folder> ...
dspzoo convert --from diffusers <folder> <out>

An unknown name prints the registry's message (with did-you-mean hints) as one line, and exits
with status 2 like any other bad argument (no usage block: ``--help`` prints it); so does a
family module (a ``dspzoo.families`` entry point or ``DSPZOO_FAMILIES``) that fails to import.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from ..core.argparser import UNRECOGNIZED, CommandParser, flag_suggestion

# Modules are imported as a command needs them: ``dspzoo --help`` imports neither torch nor a
# domain, ``list`` and ``info`` not the cost model or the benchmark.


def load_domains() -> None:
    """Import dspzoo's own domains; families of installed ``dspzoo.families`` entry points and
    ``DSPZOO_FAMILIES`` load when a lookup needs them (zoo/families.py; the registry loads all
    of them by itself)."""
    from .families import load_builtin_families

    load_builtin_families()


def _meta_count(name: str) -> str:
    from .registry import count_parameters, create_model, format_count

    return format_count(count_parameters(create_model(name, device="meta")))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (bad usage or names: one line, status 2)."""
    try:
        return _main(argv, from_shell=argv is None)
    except BrokenPipeError:  # the reader left early (``dspzoo list | head``): it had enough
        from ..core.entry import reader_gone

        return reader_gone()
    except Exception as exc:
        families = sys.modules.get(f"{__package__}.families")  # imported if it raised
        if families is not None and isinstance(exc, families.FamilyImportError):
            # a broken plugin: say which, once per launch, as the command's own error
            word = _command_word(sys.argv[1:] if argv is None else argv)
            CommandParser(prog="dspzoo" + (f" {word}" if word else "")).error(str(exc))
        raise


def _command_word(argv: list[str]) -> str | None:
    """The command of ``argv`` (its first word that is no flag: ``dspzoo`` has only -h)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _cacheable(argv: list[str]) -> bool:
    """Whether ``argv`` is ``list`` or ``info <name>``, whose output :mod:`.cli_cache` keeps."""
    if argv == ["list"]:
        return True
    return len(argv) == 2 and argv[0] == "info" and not argv[1].startswith("-")


def _main(argv: list[str] | None, from_shell: bool = False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # typed in a shell: `list` and `info <name>` print what they printed last time, if no
    # file of dspzoo changed since (zoo/cli_cache.py); called with argv (tests, scripts that
    # may have registered families of their own): always computed
    cached = from_shell and _cacheable(argv)
    if cached:
        from . import cli_cache

        text = cli_cache.lookup(argv)
        if text is not None:
            sys.stdout.write(text)
            return 0
    printed: list[str] = []

    def say(text: str) -> None:
        print(text)
        printed.append(f"{text}\n")

    code = _run(argv, say)
    if cached and code == 0:
        from . import cli_cache
        from .registry import _FAMILIES

        if all(not f.drop for f in _FAMILIES.values()):  # dspzoo's own families only
            cli_cache.store(argv, "".join(printed))
    return code


def _run(argv: list[str], say: Callable[[str], None]) -> int:
    """Run the CLI on ``argv``; ``list`` and ``info`` print through ``say``."""
    from .run_cli import COMMANDS, add_convert, run_convert, run_passthrough

    if argv and argv[0] in COMMANDS:
        load_domains()
        return run_passthrough(argv[0], argv[1:])
    parser = CommandParser(
        prog="dspzoo",
        description="dspzoo: multi-dimensional transformers under sequence parallelism",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="list models with their parameter counts")
    listing.add_argument(
        "--pretrained",
        action="store_true",
        help="list the trained models shipped with the package (data, metrics), fitted to "
        "the terminal's width",
    )
    listing.add_argument(
        "--markdown",
        action="store_true",
        help="with --pretrained: the full markdown table (data, metrics, training command)",
    )
    info = sub.add_parser("info", help="show a model's config and parameter count")
    info.add_argument(
        "name", help="model name, e.g. stdit-720M, or a shipped name (case-insensitive)"
    )
    for name, cmd in COMMANDS.items():
        what = "<model-or-folder>" if cmd.by_family else "<domain>"
        sub.add_parser(name, help=f"{cmd.help}; `dspzoo {name} {what} --help`", add_help=False)
    convert = add_convert(sub)
    plan = sub.add_parser("plan", help="predict FLOPs, bytes, memory, step time")
    bench = sub.add_parser("bench", help="benchmark every SP strategy (launch command)")
    command = _command_word(argv)
    if command == "plan":  # its flags need the cost model (torch): only for `dspzoo plan`
        from .plan_cli import build_parser as plan_parser

        plan_parser(plan)
    if command == "bench":  # docs/benchmark.md
        from ..core.bench.launch import add_arguments as bench_arguments

        bench_arguments(bench)
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command == "bench":  # scripts/benchmark.py's flags before `--`
        from ..core.bench.launch import misplaced_flags_message

        bench.error(misplaced_flags_message(argv[argv.index("bench") + 1 :]))
    if unknown:  # the hint names the command's own flags (``dspzoo list --pretraind``)
        hint = flag_suggestion(unknown, sub.choices[args.command])
        parser.error(f"{UNRECOGNIZED}{' '.join(unknown)}{hint}")
    if args.command == "convert":
        load_domains()
        return run_convert(args, convert)
    if args.command == "bench":
        from ..core.bench.launch import run as bench_run

        return bench_run(args, bench)
    load_domains()
    if args.command == "plan":
        from .plan_cli import run

        try:
            return run(args)
        except (KeyError, ValueError, ZeroDivisionError) as exc:
            plan.error(str(exc.args[0]) if exc.args else str(exc))
    from .registry import _match, get_config, list_models, resolve_name
    from .shipped import (
        describe_card,
        model_card,
        pretrained_listing,
        pretrained_table,
        shipped_names,
    )

    if args.command == "list" and args.pretrained:
        print(pretrained_table() if args.markdown else pretrained_listing())
        return 0
    if args.command == "list" and args.markdown:
        listing.error("--markdown goes with --pretrained (the shipped models' table)")
    if args.command == "list":
        for name in list_models():
            say(f"{name:<24} {_meta_count(name):>8}")
        return 0
    if _match(args.name, shipped_names()) is not None:
        say(describe_card(model_card(args.name)))
        return 0
    try:
        name = resolve_name(args.name)
    except (KeyError, ValueError) as exc:
        # str(KeyError) is the repr of its message; print the message itself
        info.error(str(exc.args[0]) if exc.args else str(exc))
    config = get_config(name)
    say(f"{name}: {_meta_count(name)} parameters")
    for f in dataclasses.fields(config):
        say(f"  {f.name:<22} {getattr(config, f.name)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

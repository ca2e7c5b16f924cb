"""``dspzoo`` command line: list the zoo and describe a model.

dspzoo list
dspzoo info stdit-720M      # names ignore case: stdit-720m works too

An unknown name prints the registry's message (with did-you-mean hints) after the usage line
and exits with status 2, as argparse does for any other bad argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from .registry import (
    count_parameters,
    create_model,
    format_count,
    get_config,
    list_models,
    resolve_name,
)

_DOMAIN_MODULES = ("dspzoo.domains.toy", "dspzoo.domains.video", "dspzoo.domains.text")


def load_domains() -> None:
    """Import the domain packages, which register their model families."""
    for name in _DOMAIN_MODULES:
        importlib.import_module(name)


def _meta_count(name: str) -> str:
    return format_count(count_parameters(create_model(name, device="meta")))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (bad usage or names exit with 2 via argparse)."""
    parser = argparse.ArgumentParser(prog="dspzoo", description="dspzoo model zoo")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list models with their parameter counts")
    info = sub.add_parser("info", help="show a model's config and parameter count")
    info.add_argument("name", help="model name, e.g. stdit-720M (case-insensitive)")
    from .plan_cli import build_parser as plan_parser  # cost model: dspzoo plan --help

    plan = plan_parser(sub.add_parser("plan", help="predict FLOPs, bytes, memory, step time"))
    from ..core.bench.launch import add_arguments as bench_arguments  # docs/benchmark.md

    bench_arguments(sub.add_parser("bench", help="benchmark every SP strategy (launch command)"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        from ..core.bench.launch import run as bench_run

        return bench_run(args)
    load_domains()
    if args.command == "plan":
        from .plan_cli import run

        try:
            return run(args)
        except (KeyError, ValueError, ZeroDivisionError) as exc:
            plan.error(str(exc.args[0]) if exc.args else str(exc))
    if args.command == "list":
        for name in list_models():
            print(f"{name:<24} {_meta_count(name):>8}")
        return 0
    try:
        name = resolve_name(args.name)
    except (KeyError, ValueError) as exc:
        # str(KeyError) is the repr of its message; print the message itself
        info.error(str(exc.args[0]) if exc.args else str(exc))
    config = get_config(name)
    print(f"{name}: {_meta_count(name)} parameters")
    for f in dataclasses.fields(config):
        print(f"  {f.name:<22} {getattr(config, f.name)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``dspzoo`` command line: list the zoo and describe a model.

dspzoo list
dspzoo info stdit-720M
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

from .registry import count_parameters, create_model, format_count, get_config, list_models

_DOMAIN_MODULES = ("dspzoo.domains.toy", "dspzoo.domains.video")


def load_domains() -> None:
    """Import the domain packages, which register their model families."""
    for name in _DOMAIN_MODULES:
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dspzoo", description="dspzoo model zoo")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list models with their parameter counts")
    info = sub.add_parser("info", help="show a model's config and parameter count")
    info.add_argument("name")
    args = parser.parse_args(argv)
    load_domains()
    if args.command == "list":
        for name in list_models():
            print(
                f"{name:<24} {format_count(count_parameters(create_model(name, device='meta'))):>8}"
            )
    else:
        config = get_config(args.name)
        print(
            f"{args.name}: {format_count(count_parameters(create_model(args.name, device='meta')))} parameters"
        )
        for f in dataclasses.fields(config):
            print(f"  {f.name:<22} {getattr(config, f.name)!r}")


if __name__ == "__main__":
    main()

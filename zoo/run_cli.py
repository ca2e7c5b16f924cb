"""``dspzoo train|sample|generate|predict|forecast|convert``: the domain scripts behind one CLI.

dspzoo train video --sp 1 --model stdit-mini --steps 300          # scripts/train_video.py
dspzoo sample stdit-mini-shapes --out shapes.gif                  # shipped name or a folder
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
    --dynamo_backend no -m dspzoo train text --sp 2 --steps 100     # under accelerate launch
dspzoo convert --from diffusers <diffusers-folder> <zoo-folder>
dspzoo convert --from transformers <mamba-folder> <zoo-folder>     # MambaForCausalLM, Mamba2…

Every flag after the domain (or the model) goes to the domain's script, so ``dspzoo train video
--help`` shows that script's flags. Errors in the input print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..core.argparser import flag_given


@dataclass(frozen=True)
class Command:
    """A pass-through subcommand: which script runs it for which key.

    ``scripts`` maps a domain (``train``) or a model family (the others) to the module under
    ``dspzoo.scripts``; ``model_flag`` is the script flag the positional model goes to.
    """

    help: str
    scripts: dict[str, str]
    by_family: bool
    model_flag: str | None = None


COMMANDS: dict[str, Command] = {
    "train": Command(
        "train a model of a domain (flags: the domain's train script)",
        {
            "video": "train_video",
            "text": "train_text",
            "protein": "train_protein",
            "weather": "train_weather",
            "mamba": "train_mamba",
            "axial3d": "train_axial3d",  # the worked example of docs/new_architecture.md
        },
        by_family=False,
    ),
    "sample": Command(
        "sample videos from a video model (shipped name or folder)",
        {"stdit": "sample_video", "latte": "sample_video", "videomamba": "sample_video"},
        by_family=True,
        model_flag="--model-dir",
    ),
    "generate": Command(
        "continue a prompt with a byte LM (shipped name or folder)",
        dict.fromkeys(("bytelm", "mambalm", "mamba2lm", "hybridlm"), "generate_text"),
        by_family=True,
        model_flag="--model-dir",
    ),
    "predict": Command(
        "predict a distogram / contact map from a FASTA file (protein model)",
        {"evoformer": "predict_protein"},
        by_family=True,
        model_flag="--model-dir",
    ),
    "forecast": Command(
        "roll out a weather forecast from a saved model",
        {"weathertx": "forecast_weather", "weathermamba": "forecast_weather"},
        by_family=True,
        model_flag="--model-dir",
    ),
}


def _usage(name: str) -> str:
    cmd = COMMANDS[name]
    what = "model-or-folder" if cmd.by_family else "domain"
    keys = ", ".join(sorted(set(cmd.scripts)))
    return (
        f"usage: dspzoo {name} <{what}> [flags of the script ...]\n\n{cmd.help}.\n"
        f"{'families' if cmd.by_family else 'domains'}: {keys}\n"
        f"`dspzoo {name} <{what}> --help` lists the script's flags."
    )


def _family_of_model(ref: str) -> str:
    """The model family of a shipped name or a checkpoint folder."""
    from ..core.entry import UsageError
    from .pretrained import _read_meta
    from .shipped import resolve_pretrained

    try:
        return _read_meta(resolve_pretrained(ref))["family"]
    except (KeyError, FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc.args[0]) if exc.args else str(exc)) from exc


def _resolve(name: str, argv: list[str]) -> tuple[Callable[[], object], list[str]]:
    """The script's ``main`` and the argv it should see."""
    from ..core.entry import UsageError  # (torch: not imported for ``dspzoo --help``)

    cmd = COMMANDS[name]
    key, rest = argv[0], argv[1:]
    if cmd.by_family:
        family = _family_of_model(key)
        if family not in cmd.scripts:
            raise UsageError(
                f"{key!r} is a {family!r} model; `dspzoo {name}` takes "
                f"{sorted(set(cmd.scripts))} models"
            )
        # the flag would replace the positional model; "--model" (which no by-model script
        # takes) means the same to whoever types it
        given = flag_given(cmd.model_flag, rest) or flag_given("--model", rest)
        if given:
            raise UsageError(
                f"the model is given once: `dspzoo {name} <model or folder>` takes it as its "
                f"first word ({key!r} here), so drop {given}"
            )
        module, rest = cmd.scripts[family], [cmd.model_flag, key, *rest]
    else:
        if key not in cmd.scripts:
            raise UsageError(f"unknown domain {key!r}; choose from {sorted(cmd.scripts)}")
        module = cmd.scripts[key]
    try:
        script = importlib.import_module(f"dspzoo.scripts.{module}")
    except ModuleNotFoundError as exc:
        raise UsageError(f"scripts/{module}.py is not available in this install: {exc}") from exc
    return script.main, [f"dspzoo {name} {key}", *rest]


def run_passthrough(name: str, argv: list[str]) -> int:
    """Run ``dspzoo <name> <key> ...``; returns the exit status."""
    from ..core.entry import UsageError, run_entry_point

    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(name))
        return 0 if argv else 2
    try:
        main, script_argv = _resolve(name, argv)
    except UsageError as exc:
        print(f"{_usage(name).splitlines()[0]}\ndspzoo {name}: error: {exc}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = script_argv
    try:  # bad input: one line, status 2, once across the ranks of a launch
        return run_entry_point(main, script_argv[0])  # "dspzoo train text", as the parser
    finally:
        sys.argv = saved


def add_convert(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "convert",
        help="convert a foreign checkpoint folder into a zoo model folder",
        description="Convert a checkpoint folder from another library into a dspzoo folder "
        "(config.json + model.safetensors) that from_pretrained and every script load.",
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        choices=["diffusers", "transformers"],
        help="format of the input: diffusers (a LatteTransformer3DModel folder with "
        "config.json and safetensors weights) or transformers (a MambaForCausalLM / "
        "Mamba2ForCausalLM folder)",
    )
    parser.add_argument("src", help="the folder to convert")
    parser.add_argument("dst", help="the zoo folder to write (replaced atomically)")
    return parser


def run_convert(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if args.source == "transformers":
            from dspzoo.domains.mamba.convert import convert_folder
        else:
            from .convert.diffusers_latte import convert_folder
    except ModuleNotFoundError as exc:
        parser.error(f"the {args.source} converter is not available: {exc}")
    try:
        out = convert_folder(args.src, args.dst)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))
    print(f"wrote {out}")
    return 0

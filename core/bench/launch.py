"""``dspzoo bench``: the exact ``accelerate launch`` command of the benchmark, printed or run.

dspzoo bench -n 2                                   # print the command (video default)
dspzoo bench -n 2 --run -- --model bytelm-small     # run it; args after -- go to the script
dspzoo bench -n 2 --mixed-precision bf16 --run      # the steps under bf16 autocast

``--mixed-precision`` is the benchmark's own flag (it may also go after ``--``); Accelerate's
``--mixed_precision`` stays ``no``: the benchmark autocasts its steps itself.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from ..argparser import positive_int
from ..entry import UsageError
from .precision import PRECISIONS, Precision, refuse_unsupported

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--num-processes",
        type=positive_int,
        default=2,
        help="processes = SP size N (default 2); 1 runs SP 1 in one process",
    )
    parser.add_argument("--run", action="store_true", help="launch it (default: print it)")
    parser.add_argument(
        "--mixed-precision",
        choices=PRECISIONS,
        default=None,
        help="the steps under torch.autocast in this dtype, fp32 parameters (passed on to "
        "scripts/benchmark.py; default: fp32 steps; fp16 needs a CUDA GPU)",
    )
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="after --: scripts/benchmark.py flags"
    )


LAUNCH_FLAGS = ("-n", "--num-processes", "--mixed-precision")


def misplaced_flags_message(argv: list[str]) -> str:
    """The error for benchmark flags given before ``--`` (``argv``: the words after
    ``dspzoo bench``): which flags they are, and the command with them after ``--``."""
    own, script = [], []
    words = iter(argv)
    for word in words:
        if word == "--":
            script += list(words)
        elif word in LAUNCH_FLAGS:
            own += [word, next(words, "")]
        elif word == "--run" or word.startswith(("--num-processes=", "-n")):
            own.append(word)
        else:
            script.append(word)
    if "--run" not in own:
        own.append("--run")
    flags = ", ".join(w for w in script if w.startswith("-"))
    example = shlex.join(["dspzoo", "bench", *own, "--", *script])
    return (
        f"flags of the benchmark ({flags}, …) go after `--`: {example} "
        f"(without --run: print the command)"
    )


def command(num_processes: int, script_args: list[str]) -> list[str]:
    """The ``accelerate launch`` line (``--multi_gpu`` only for several processes: Accelerate
    refuses it for one)."""
    extra = script_args[1:] if script_args[:1] == ["--"] else script_args
    multi = ["--multi_gpu"] if num_processes > 1 else []
    return [
        "accelerate", "launch", *multi, "--num_processes", str(num_processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(SCRIPT), *extra,
    ]  # fmt: skip


def script_arguments(args: argparse.Namespace) -> tuple[list[str], str]:
    """The benchmark's flags: those after ``--``, with ``--mixed-precision`` when given to
    ``dspzoo bench`` itself (a different value after ``--`` is refused); and the precision
    the run takes (``no`` when given nowhere)."""
    extra = args.script_args[1:] if args.script_args[:1] == ["--"] else list(args.script_args)
    given = getattr(args, "mixed_precision", None)
    after = _precision_parser().parse_known_args(extra)[0].mixed_precision
    if given is not None and after not in (None, given):
        raise UsageError(
            f"--mixed-precision {given} before `--` and --mixed-precision {after} after it: "
            "give it once"
        )
    if given is not None and after is None:
        extra = [*extra, "--mixed-precision", given]
    return extra, after or given or "no"


def check_script_arguments(script_args: list[str]) -> None:
    """Parse the benchmark's flags as every launched process will (:func:`.runner.parse_args`),
    raising a :class:`UsageError` with the benchmark parser's message for a bad one (an
    unknown flag, a model the benchmark does not run, a misspelt strategy): refused here, once,
    rather than after launching N processes."""
    from .runner import build_parser, parse_args

    script_parser = build_parser()

    def refuse(message: str) -> None:  # dspzoo bench's parser says it (with its hint)
        raise UsageError(message)

    script_parser.error = refuse  # type: ignore[method-assign,assignment]
    parse_args(script_args, script_parser)


def _precision_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--mixed-precision", default=None)
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print (``--run``: launch) the benchmark's command; bad flags are ``parser``'s usage
    errors (one line, status 2, as every other ``dspzoo`` command says them)."""
    if {"-h", "--help"} & set(args.script_args):  # the benchmark's own flags, not a launch
        from .runner import build_parser

        build_parser().print_help()
        return 0
    try:
        script_args, precision = script_arguments(args)
        check_script_arguments(script_args)  # printed or run: a command that would fail
        if args.run:  # refused here rather than by every launched process
            refuse_unsupported(Precision(precision), torch.cuda.is_available())
    except UsageError as exc:
        parser.error(str(exc))
    cmd = command(args.num_processes, script_args)
    print(shlex.join(cmd), flush=True)
    if not args.run:
        print("(printed, not run: add --run to launch it)", file=sys.stderr)
        return 0
    launch = [sys.executable, "-m", "accelerate.commands.launch", *cmd[2:]]
    return subprocess.call(launch)

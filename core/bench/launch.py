"""``dspzoo bench``: the exact ``accelerate launch`` command of the benchmark, printed or run.

dspzoo bench -n 2                                   # print the command (video default)
dspzoo bench -n 2 --run -- --model bytelm-small     # run it; args after -- go to the script
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--num-processes",
        type=int,
        default=2,
        help="processes = SP size N (default 2); 1 runs SP 1 in one process",
    )
    parser.add_argument("--run", action="store_true", help="launch it (default: print it)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="after --: scripts/benchmark.py flags"
    )


LAUNCH_FLAGS = ("-n", "--num-processes")


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


def run(args: argparse.Namespace) -> int:
    cmd = command(args.num_processes, args.script_args)
    print(shlex.join(cmd), flush=True)
    if not args.run:
        print("(printed, not run: add --run to launch it)", file=sys.stderr)
        return 0
    launch = [sys.executable, "-m", "accelerate.commands.launch", *cmd[2:]]
    return subprocess.call(launch)

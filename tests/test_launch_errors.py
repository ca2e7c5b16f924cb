"""Bad input and bugs under ``torchrun`` (as under ``accelerate launch``).

Bad input: one line, status 2 on every rank; the launcher's report ends with that line again
(its root cause, from the error file the printing rank writes). A bug: the failing rank's
traceback once, one line from the other rank naming it, status 1.

Two launches of two processes each: ``dspzoo train video`` with an ``--sp`` that does not divide
the world (every rank sees it once the process group is up), and a run where only rank 0 sees
bad input while rank 1 waits in a collective with it (rank 1's collective then fails; it must
exit with 2 too, silently). The launcher's own report of the failed ranks (its traceback of
``ChildFailedError`` and the per-rank table) cannot be silenced from the ranks, so the test
checks that it is the only other output: the one traceback in the output is the launcher's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

ONE_RANK_FAILS = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from dspzoo.core.entry import run_entry_point
    from dspzoo.core.errors import MissingFileError

    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            raise MissingFileError("--data /no/such/folder: no such folder")
        for _ in range(3):  # rank 0 has left: gloo fails this collective
            dist.all_reduce(torch.ones(4))

    raise SystemExit(run_entry_point(main, "prog"))
    """
)


def _torchrun(*command: str, tmp_path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOGLEVEL"))}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + list(command),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    return done.returncode, done.stdout + done.stderr


def _check(output: str, message: str) -> None:
    assert output.count(message) == 2, output  # the rank's line, and the report's root cause
    assert "usage:" not in output and output.count(": error: ") == 2, output  # no usage block
    assert re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output) == ["2", "2"], output
    assert output.count("Traceback") == 1, output  # the launcher's report, below
    before, launcher_report = output.split("Traceback")
    assert message in before, output  # printed by the rank, above the launcher's report
    assert "torch/distributed/run.py" in launcher_report and "ChildFailedError" in launcher_report
    assert "Connection closed" not in output and "DistBackendError" not in output, output
    last = [line for line in output.splitlines() if line.strip(" =")][-1]
    assert last.strip().startswith(f"traceback : {message}"), output  # the last line read


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["-m", "dspzoo", "train", "video", "--sp", "3", "--steps", "1"],
            "dspzoo train video: error: sp_size=3 does not divide the world size 2",
        ),
        (["one_rank_fails.py"], "prog: error: --data /no/such/folder: no such folder"),
        (
            ["-m", "dspzoo", "train", "video", "--steps", "x"],
            "dspzoo train video: error: argument --steps: invalid int value: 'x' "
            "(see dspzoo train video --help)",
        ),
    ],
    ids=["every-rank-sees-it", "one-rank-sees-it", "a-bad-flag-before-the-group"],
)
def test_bad_input_under_torchrun_is_one_line_and_status_2(command, message, tmp_path) -> None:
    (tmp_path / "one_rank_fails.py").write_text(ONE_RANK_FAILS)
    status, output = _torchrun(*command, tmp_path=tmp_path)
    assert status != 0
    _check(output, message)


# A bug mid-training: rank 0 meets an internal KeyError in its second step while rank 1 goes on
# into the step's collectives (which then fail when rank 0 leaves).
BUG_IN_A_STEP = textwrap.dedent(
    """
    import sys

    import torch.distributed as dist

    from dspzoo.core.entry import run_entry_point
    from dspzoo.core.train.trainer import Trainer
    from dspzoo.scripts.train_text import main

    real_step = Trainer.step

    def step(self, batch, step, meter=None):
        if step == 2 and dist.get_rank() == 0:
            {}["injected"]  # a bug: an internal KeyError
        return real_step(self, batch, step, meter)

    Trainer.step = step
    sys.argv = ["train_text.py", *sys.argv[1:]]
    raise SystemExit(run_entry_point(main, "train_text.py"))
    """
)


def test_a_bug_mid_training_is_one_traceback_and_status_1(tmp_path) -> None:
    (tmp_path / "bug_in_a_step.py").write_text(BUG_IN_A_STEP)
    status, output = _torchrun(
        "bug_in_a_step.py", "--sp", "2", "--model", "bytelm-tiny", "--steps", "3",
        "--global-batch", "2", "--output-dir", str(tmp_path / "out"), tmp_path=tmp_path,
    )  # fmt: skip
    assert status != 0
    assert re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output) == ["1", "1"], output
    assert output.count("Traceback") == 2, output  # rank 0's, then the launcher's report
    ours, launcher_report = output.split("Traceback")[1:]
    assert 'bug_in_a_step.py", line' in ours and "KeyError: 'injected'" in ours, output
    assert output.count("KeyError: 'injected'") == 1, output  # no second copy of it anywhere
    line = (
        "train_text.py: rank 1 stopped: rank 0 failed with an internal error; its traceback "
        "is above (or in rank 0's log)"
    )
    assert output.count(line) == 1 and line in ours, output  # one line, after the traceback
    assert ": error: " not in output, output  # not reported as bad input
    assert "Connection closed" not in output and "DistBackendError" not in output, output
    assert "train_text.py: internal error on rank 0: KeyError: injected" in launcher_report

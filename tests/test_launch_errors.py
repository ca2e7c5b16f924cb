"""Bad input under ``torchrun`` (as under ``accelerate launch``): one line, status 2 on every rank.

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

    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            raise FileNotFoundError("--data /no/such/folder: no such folder")
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
    assert output.count(message) == 1, output
    assert "usage:" not in output and output.count(": error: ") == 1, output  # no usage block
    assert re.findall(r"exitcode\s+:\s*(-?\d+) \(pid", output) == ["2", "2"], output
    assert output.count("Traceback") == 1, output  # the launcher's report, below
    launcher_report = output[output.index("Traceback") :]
    assert "torch/distributed/run.py" in launcher_report and "ChildFailedError" in launcher_report
    assert "Connection closed" not in output and "DistBackendError" not in output, output


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

"""Old module paths keep working after the moves into ``core/parallel`` and ``core/train``: each
names the moved module itself (one module object, its own spec), and the moved modules hold
what the old ones exported."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED = {
    "dspzoo.core.runtime": "dspzoo.core.parallel.runtime",
    "dspzoo.core.plan": "dspzoo.core.parallel.plan",
    "dspzoo.core.mesh": "dspzoo.core.parallel.mesh",
    "dspzoo.core.comm.exchange": "dspzoo.core.parallel.comm.exchange",
    "dspzoo.core.methods.ring": "dspzoo.core.parallel.methods.ring",
    "dspzoo.core.checkpoint": "dspzoo.core.train.checkpoint",
    "dspzoo.core.configflags": "dspzoo.core.train.flags",
    "dspzoo.core.ema": "dspzoo.core.train.ema",
    "dspzoo.core.loop": "dspzoo.core.train.loop",
    "dspzoo.core.resume": "dspzoo.core.train.resume",
    "dspzoo.core.runconfig": "dspzoo.core.train.config",
    "dspzoo.core.tensor_parallel_training": "dspzoo.core.train.tensor_parallel",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_moved_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert new.__spec__.name == MOVED[old]  # the alias does not rename the module


def test_old_names_import_in_a_fresh_interpreter_without_loading_the_trainer() -> None:
    code = (
        "import sys, dspzoo.core\n"
        "assert 'dspzoo.core.train' not in sys.modules\n"
        "from dspzoo.core.configflags import TrainingCLI\n"
        "from dspzoo.core.runconfig import NOT_WIRED\n"
        "from dspzoo.core.train.flags import TrainingCLI as T\n"
        "assert TrainingCLI is T\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

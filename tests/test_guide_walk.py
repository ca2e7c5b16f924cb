"""docs/new_architecture.md walked again with a model that is not the worked example:
``examples/spectro2d.py`` (frequency x time, layers alternating ``@0`` axial + a generic
convolution and ``@1`` full 2-D attention), registered from outside dspzoo's built-ins.

Each step of the guide: the plans (a generic stage gets its dim whole, the full stage is run
by an embedded method), the tensor-parallel contract, the harness under every strategy at SP
2, 3 and 4 on a grid no SP size divides (outputs, gradients and traced bytes against the cost
model), and ``dspzoo plan`` reaching the family through ``DSPZOO_FAMILIES`` only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from dspzoo.core.harness import check_model
from dspzoo.core.parallel.strategies import STRATEGIES, get_strategy
from dspzoo.core.parallel.tp_contract import check_tp_contract
from dspzoo.examples.spectro2d import (
    SEQ_DIMS,
    STAGES,
    Spectro2D,
    Spectro2DConfig,
    workload,
)
from dspzoo.zoo.families import BUILTIN_MODULES

CONFIG = Spectro2DConfig(hidden=16, heads=4, depth=2, max_freq=16)
FREQ, TIME = 7, 5  # no SP size of 2, 3, 4 divides either


def make_model() -> nn.Module:
    return Spectro2D(CONFIG)


def make_inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, FREQ, TIME, 1, generator=torch.Generator().manual_seed(3))}


def test_the_plans_of_alternating_layers_with_a_generic_stage() -> None:
    assert "dspzoo.examples.spectro2d" not in BUILTIN_MODULES  # a family "of your own"
    assert [s.name for s in STAGES] == ["time@0", "band@0", "mlp@0", "full@1", "mlp@1"]
    for name in ("dsp", "ulysses", "ring", "lss", "megatron_sp"):
        plan = get_strategy(name).plan(SEQ_DIMS, (FREQ, TIME), STAGES, 3)
        band = plan.step_for("band@0")
        assert band.sharded == "t" and band.method == "local", (name, band)  # f whole
    dsp = get_strategy("dsp").plan(SEQ_DIMS, (FREQ, TIME), STAGES, 3)
    assert dsp.methods["full@1"] == "ulysses"  # mixes every dim: a hybrid method
    assert dsp.switches_per_period == 2
    check_tp_contract(make_model())
    with pytest.raises(ValueError, match="even depth"):
        Spectro2D(Spectro2DConfig(depth=3))


@pytest.mark.timeout(280)
def test_spectro2d_equals_one_process_under_every_strategy_at_sp_2_3_4() -> None:
    wl = workload("spectro2d-walk", CONFIG, spatial=(FREQ, TIME), batch=2)
    report = check_model(make_model, make_inputs, workload=wl, timeout=260)
    assert {c.strategy for c in report.checks} == set(STRATEGIES)
    assert report.not_runnable == {}  # 4 heads: every strategy runs at SP 2, 3 and 4
    assert all(c.plan_bytes == c.traced_bytes > 0 for c in report.checks)
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


def _cli(*args: str, families: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DSPZOO_FAMILIES"}
    if families:
        env["DSPZOO_FAMILIES"] = families
    cmd = [sys.executable, "-m", "dspzoo.zoo.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_dspzoo_plan_reaches_the_family_through_the_environment_variable() -> None:
    argv = ["plan", "spectro2d-tiny", "--dims", "f=64,t=256", "--sp", "1,4"]
    proc = _cli(*argv, "--strategies", "dsp,ulysses", families="dspzoo.examples.spectro2d")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("spectro2d-tiny: ") and "tokens (f=64, t=256)" in lines[0]
    rows = {tuple(line.split()[:2]) for line in lines if line[:3].strip() == "4"}
    assert rows == {("4", "dsp"), ("4", "ulysses")}
    missing = _cli(*argv, families=None)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "unknown model family 'spectro2d'" in missing.stderr
    assert "DSPZOO_FAMILIES" in missing.stderr


def test_the_guide_quotes_spectro2d_as_it_is_and_has_the_contract_section() -> None:
    from pathlib import Path

    from dspzoo.core.parallel.tp_contract import CONTRACT_DOC

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "new_architecture.md").read_text()
    source = (root / "examples" / "spectro2d.py").read_text()
    blocks = re.findall(r"<!-- listing: examples/spectro2d.py -->\n```python\n(.*?)```", doc, re.S)
    assert blocks and all(block in source for block in blocks)
    section = CONTRACT_DOC.split("'")[1]  # the error messages point to this heading
    assert f"\n### {section}\n" in doc
    for heading in ("op kinds", "Layers that alternate", "A second walk"):
        assert heading in doc

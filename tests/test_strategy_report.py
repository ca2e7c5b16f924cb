"""scripts/strategy_report.py: its byte formulas, and one tiny 2-process report.

The formulas are checked against the textbook even-case values (DSP 2 switches per axial
layer, Ulysses 4 units, ring/LSS K/V volumes, Megatron-SP 2N units per linear pair), against
uneven-shard bookkeeping, and against the planner; the launch checks that every strategy's
traced bytes equal its formula on every rank and block, and that outputs agree with DSP's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspzoo.core.parallel.plan import Stage, plan_fixed, plan_stages

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import strategy_report as sr
finally:
    sys.path.remove(str(REPO / "scripts"))

AXIAL = (Stage("spatial", ("s",)), Stage("temporal", ("t",)), Stage("cross"), Stage("mlp"))


def test_even_method_formulas_are_the_textbook_units() -> None:
    n, b, length, heads, d, item = 4, 2, 64, 8, 16, 4
    attn = sr.Attn(heads, heads, d)
    m = b * length * heads * d * item  # bytes of the global activation (= of q, k or v)
    unit = m / n * (n - 1) / n
    seq = sr.shard_sizes(length, n)
    for r in range(n):
        assert sr.method_bytes("ulysses", b, seq, attn, r, item) == (4 * unit, 4 * unit)
        assert sr.method_bytes("lss", b, seq, attn, r, item) == (2 * (n - 1) * m / n,) * 2
        fwd, bwd = sr.method_bytes("ring", b, seq, attn, r, item)
        assert fwd == 2 * (n - 1) * m / n and bwd == fwd + 2 * m
        assert sr.megatron_bytes(b, seq, heads * d, item) == (2 * (n - 1) * m / n,) * 2
        # USP 2 × 2: Ulysses inside pairs, ring over the 2 slots
        uf, ub = sr.method_bytes("usp", b, seq, attn, r, item, 2)
        ulysses = 4 * m / n * (2 - 1) / 2
        assert (
            uf == ulysses + 2 * (2 - 1) * m / n
            and ub == ulysses + 2 * (2 - 1) * m / n + 2 * 2 * m / n
        )
    # KV-aligned GQA: q and output 2 units, k and v 2·Hkv/H
    gqa = sr.Attn(heads, 4, d)
    assert sr.method_bytes("ulysses", b, seq, gqa, 0, item)[0] == pytest.approx(
        (2 + 2 * 4 / heads) * unit
    )
    # 2 KV heads (or MQA) at N = 4 cut KV groups: k and v are expanded to the query heads
    for kv in (2, 1):
        assert sr.method_bytes("ulysses", b, seq, sr.Attn(heads, kv, d), 0, item)[0] == 4 * unit


def test_uneven_switch_backward_sends_what_the_forward_received() -> None:
    src = sr.shard_sizes(10, 3)  # [4, 3, 3]
    fwd = [sr.switch_bytes(1, src, 7, r, 3, 1, 1) for r in range(3)]
    dst = sr.shard_sizes(7, 3)  # [3, 2, 2]
    assert fwd == [4 * (7 - 3), 3 * (7 - 2), 3 * (7 - 2)]
    assert sum(fwd) == sum(dst[r] * (10 - src[r]) for r in range(3))


def test_block_formula_walks_the_dsp_plan() -> None:
    n, lengths, attn = 2, {"t": 16, "s": 64}, sr.Attn(4, 4, 16)
    plan = plan_stages(("t", "s"), (16, 64), AXIAL, n)
    names = [s.name for s in AXIAL]
    blocks = sr.plan_formula(plan, names, 2, 0, lengths, 1, attn, n, 0, 4, extra=1)
    unit = 16 * 64 * 64 * 4 / n * (n - 1) / n
    assert blocks[-1] == (2 * unit, 2 * unit)  # steady state: two switches per layer
    assert sum(f for f, _ in blocks[:2]) == 3 * unit  # the entry split saves the first one
    # an embedded strategy on s: one Ulysses stage per layer, no switch
    fixed = plan_fixed(("t", "s"), (16, 64), AXIAL, n, "ulysses")
    f, b, dim, kinds = sr.block_formula(fixed, 0, "s", names, lengths, 1, attn, n, 1, 4)
    assert (f, b, dim) == (4 * unit, 4 * unit, "s") and set(kinds) == {"ulysses"}


def test_block_stage_names_of_a_hybrid_period() -> None:
    names = ["spatial@0", "temporal@0", "mlp@0", "full@1", "mlp@1"]
    assert sr.block_stage_names(names, 3, 2) == ["full@1", "mlp@1"]
    assert sr.block_stage_names(names, 0, 0) == names


@pytest.mark.timeout(150)
def test_two_process_report_matches_its_formulas(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "scripts" / "strategy_report.py"),
        "--model",
        "stdit-tiny",
        "--frames",
        "5",
        "--latent",
        "6",
        "--full-attention-every",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "reproduce: " in proc.stdout
    report = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    assert {"dsp", "ulysses", "ring", "ring_zigzag", "lss", "usp"} <= set(rows)
    for name, row in rows.items():
        assert row["formula_matches"], (
            name,
            row["traced_per_block_rank0"],
            row["formula_per_block_rank0"],
        )
        assert row["max_abs_out_diff"] < 1e-4 and row["max_abs_grad_diff"] < 1e-4, name
        assert row["activation_bytes"] > 0
    assert rows["dsp"]["methods"] == ["ulysses"]  # the hybrid: the full layer runs embedded

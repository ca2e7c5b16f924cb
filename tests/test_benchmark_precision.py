"""The benchmark under ``--mixed-precision`` (``dspzoo.core.bench.precision``).

bf16 on the CPU: the step runs under autocast with fp32 parameters; a one-process run and a
2-process run (every strategy, gloo) name bf16 in their report, agree with one process within
the dtype's tolerance (and not within fp32's: the rounding is real), and send what the report
says: the elements of the cost model's formula, in the dtypes the "sent as" column names. The
check still flags a wrong gradient under bf16. fp16 is refused on a CPU, with the fix, by every
rank and by ``dspzoo bench --run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_marks import CUDA
from test_benchmark import REPO, _launch

from dspzoo.core.bench import build_parser
from dspzoo.core.bench.case import build_case
from dspzoo.core.bench.check import compare, one_process_reference
from dspzoo.core.bench.precision import (
    FP32_RTOL,
    MAX_RTOL,
    Precision,
    fp32_equivalent,
    loss_scales,
    scaled_backward,
    sharded_loss_scale,
    tolerance,
    tolerance_for,
)
from dspzoo.core.bench.report import sent_as
from dspzoo.core.parallel.strategies import STRATEGIES

TINY = ("--model", "stdit-tiny", "--frames", "4", "--latent", "8")
BF16_RTOL = 8 * 2**-7  # 8 × bf16's machine epsilon (8 significant bits)
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where CUDA is")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return env


def _one_process(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """scripts/benchmark.py in one process (SP 1, no launcher)."""
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--peer", "off",
           "--cluster", "none", "--no-progress", "--out", str(tmp_path / "bench"), *flags]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(tmp_path))


def _assert_names_bf16(result: dict, out: Path) -> None:
    assert (result["precision"], result["itemsize"]) == ("bf16", 2)
    assert result["rtol"] == pytest.approx(BF16_RTOL)
    text = (out / "results.md").read_text()
    assert text.startswith("## stdit-tiny") and text.splitlines()[0].endswith("— bf16 autocast")
    assert "Precision: bf16 autocast (fp32 parameters)" in text
    assert "flagged above 6.2e-02" in text
    assert "--mixed-precision bf16" in text.split("reproduce: ")[1]


# -- the step -----------------------------------------------------------------------------------
def test_the_step_runs_under_bf16_autocast_with_fp32_parameters() -> None:
    from dspzoo.core.parallel.runtime import SeqParallel

    case = build_case(build_parser().parse_args([*TINY, "--mixed-precision", "bf16"]), 1)
    assert case.precision == Precision("bf16") and case.workload(1).itemsize == 2
    assert case.workload(1, itemsize=4).itemsize == 4
    loss, out = case.step(case.model, SeqParallel(), case.inputs)
    assert out.tensor.dtype == torch.bfloat16  # the head's linear ran in bf16
    loss.backward()
    params = list(case.model.parameters())
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    fp32 = build_case(build_parser().parse_args(list(TINY)), 1)
    assert fp32.step(fp32.model, SeqParallel(), fp32.inputs)[1].tensor.dtype == torch.float32


def test_the_tolerance_follows_the_dtype_and_bytes_count_elements() -> None:
    assert tolerance(None) == FP32_RTOL == Precision("no").rtol == 1e-4
    assert Precision("bf16").rtol == pytest.approx(BF16_RTOL)  # 6.25e-2
    assert Precision("fp16").rtol == pytest.approx(8 * 2**-10)  # fp16: 11 significant bits
    assert (Precision("no").itemsize, Precision("bf16").itemsize) == (4, 2)
    assert fp32_equivalent(6, "bfloat16") == fp32_equivalent(6, "float16") == 12
    assert fp32_equivalent(12, "float32") == 12 and fp32_equivalent(4, "int32") == 4
    assert sent_as({"int32": 4, "bfloat16": 100, "float32": 300}) == "bf16 25%, fp32 75%"
    assert sent_as({"int32": 4}) == "–"
    with pytest.raises(Exception, match="choose one of no, bf16, fp16"):
        Precision("fp8")
    # the step's own rounding raises the tolerance of a deep model, never lowers the floor
    assert tolerance_for(torch.bfloat16, 1e-3) == pytest.approx(BF16_RTOL)
    assert tolerance_for(torch.bfloat16, 3e-2) == pytest.approx(4 * 3e-2)
    assert tolerance_for(None, 0.5) == FP32_RTOL
    # however rounded the step, a gradient off by half (a missed SP-group mean) stays flagged
    assert tolerance_for(torch.float16, 0.97) == MAX_RTOL < 0.5


def test_loss_scaling_gives_the_plain_gradients_and_reports_overflow() -> None:
    assert loss_scales(Precision("fp16"))[0] == 2.0**16 and loss_scales(Precision("fp16"))[-1] == 1
    assert loss_scales(Precision("bf16")) == loss_scales(Precision("no")) == (1.0,)
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(5, 3), torch.randn(4, 5)
    layer(x).square().mean().backward()
    plain = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    assert scaled_backward(layer(x).square().mean(), layer.parameters(), 2.0**16)
    for got, want in zip((p.grad for p in layer.parameters()), plain):
        torch.testing.assert_close(got, want)  # a power of two: exact in fp32
    # fp16 gradients that overflow at GradScaler's 2^16 and not at 2; a scale is divided by
    # the SP size rounded up to a power of two, to room for the sharded step's N-fold gradients
    half = torch.nn.Linear(5, 3).half()
    xh = torch.full((4, 5), 30.0, dtype=torch.float16)
    assert not scaled_backward(half(xh).float().square().sum(), half.parameters(), 2.0**16)
    half.zero_grad()
    assert scaled_backward(half(xh).float().square().sum(), half.parameters(), 2.0)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters())
    assert sharded_loss_scale(2.0**16, 1) == 2.0**16 and sharded_loss_scale(2.0**16, 2) == 2.0**15
    assert sharded_loss_scale(2.0**16, 3) == sharded_loss_scale(2.0**16, 4) == 2.0**14
    assert sharded_loss_scale(2.0, 8) == sharded_loss_scale(1.0, 4) == 1.0
    # the report names an overflow apart from a disagreement
    from dspzoo.core.bench.report import _verdict

    assert _verdict({"agrees": False, "finite_grads": False}) == "NON-FINITE"
    assert _verdict({"agrees": False, "finite_grads": True}) == "DIFFERS"
    assert _verdict({"agrees": True}) == "ok"


def test_the_check_still_catches_a_wrong_gradient_under_bf16() -> None:
    """Against a bf16 one-process reference: the fp32 step of the same weights differs by bf16
    rounding only (within bf16's tolerance, beyond fp32's), while a gradient that missed the
    SP-group mean (half its size) or lost a parameter is flagged."""
    from dspzoo.core.parallel.runtime import SeqParallel

    case = build_case(build_parser().parse_args([*TINY, "--mixed-precision", "bf16"]), 1)
    reference = one_process_reference(case, case.inputs)
    fp32 = build_case(build_parser().parse_args(list(TINY)), 1)
    loss, out = fp32.step(fp32.model, SeqParallel(), fp32.inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in fp32.model.named_parameters()}
    output = out.tensor.detach()
    # the reference measured its own rounding against this very fp32 step (the same errors,
    # up to which of the two is the denominator's max)
    against_fp32 = compare(reference, output, grads)
    rounding = max(against_fp32.output_error, against_fp32.grad_error)
    assert reference.rounding == pytest.approx(rounding, rel=1e-2) and rounding > FP32_RTOL
    assert reference.rtol == tolerance_for(torch.bfloat16, reference.rounding)
    rounded = compare(reference, output, grads)
    assert rounded.ok and max(rounded.output_error, rounded.grad_error) > FP32_RTOL
    assert not compare(reference, output, grads, FP32_RTOL).ok  # fp32's tolerance: too tight
    name = rounded.worst_param
    halved = compare(reference, output, {**grads, name: grads[name] / 2}, Precision("bf16").rtol)
    assert not halved.ok and halved.grad_error > 0.4 and halved.worst_param == name
    missing = compare(reference, output, {k: v for k, v in grads.items() if k != name}, 0.0625)
    assert not missing.ok and missing.missing == [name]
    shifted = compare(reference, output.roll(1, dims=1), grads, Precision("bf16").rtol)
    assert not shifted.ok and shifted.output_error > BF16_RTOL  # tokens in the wrong place


# -- launches ----------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_a_bf16_run_at_sp1(tmp_path: Path) -> None:
    proc = _one_process(tmp_path, *TINY, "--reps", "1", "--mixed-precision", "bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reproduce: `python " in proc.stdout
    result = json.loads((tmp_path / "bench" / "results.json").read_text())
    _assert_names_bf16(result, tmp_path / "bench")
    (row,) = result["rows"]
    assert row["strategy"] == "dsp" and row["agrees"] and len(row["times"]) == 1
    assert row["bytes"] == row["formula_bytes"] == 0 and row["formula_exact"]


@pytest.mark.timeout(170)
def test_a_bf16_run_at_sp2_sends_what_its_report_says(tmp_path: Path) -> None:
    result = _launch(tmp_path, *TINY, "--reps", "1", "--mixed-precision", "bf16")
    _assert_names_bf16(result, result["_out"])
    rows = {r["strategy"]: r for r in result["rows"]}
    assert list(rows) == ["dsp", *[s for s in STRATEGIES if s != "dsp"]]
    for name, r in rows.items():
        assert r["agrees"] and r["formula_exact"], (name, r["grad_error"], r["bytes_by_op"])
        assert r["grad_error"] <= BF16_RTOL and len(r["times"]) == 1
        for traced, by_dtype in zip(r["bytes_by_op"], r["bytes_by_dtype"]):
            assert sum(traced.values()) == sum(by_dtype.values())  # the split covers every byte
    # the rounding is real: fp32's tolerance would have flagged the runs
    assert max(r["grad_error"] for r in rows.values()) > FP32_RTOL
    # what each sends, byte for byte the cost model's formula at the run's element sizes: the
    # linears' and attention's outputs in bf16, the residual stream in fp32 (DSP's switches,
    # Megatron-SP's all-gather of a norm's output and its backward reduce-scatter)
    for name, r in rows.items():
        assert r["bytes_by_op"] == r["formula_bytes_by_op"], name
    dsp, uly, meg = rows["dsp"], rows["ulysses"], rows["megatron_sp"]
    assert set(dsp["bytes_by_dtype"][0]) == {"float32"}  # the input check: no payload
    assert set(uly["bytes_by_dtype"][0]) == {"bfloat16"}
    for traced in meg["bytes_by_op"]:  # the stream's collectives at 4 bytes, the others at 2
        assert traced["all_gather/forward"] == 2 * traced["all_gather/backward"] > 0
        assert traced["reduce_scatter/backward"] == 2 * traced["reduce_scatter/forward"] > 0
    assert uly["bytes"] < rows["ring"]["bytes"] == rows["ring"]["formula_bytes"]  # fp32 dK/dV
    table = (result["_out"] / "results.md").read_text()
    assert all(r["formula_bytes_exact"] for r in rows.values())
    assert "formula at 2 B/elem, stream 4" in table and "| = bytes/elements |" in table
    assert "| bytes | 1.00 | fp32 100% |" in table.split("| dsp | local |")[1].splitlines()[0]
    assert "| bf16 100% |" in table.split("| ulysses | ulysses |")[1].splitlines()[0]
    assert "bf16 33%, fp32 67%" in table.split("| ring | ring |")[1].splitlines()[0]


# -- fp16 on a CPU --------------------------------------------------------------------------------
FIX = "--mixed-precision fp16 needs a CUDA GPU: CPU autocast runs bf16 only (use --mixed-precision bf16 on a CPU)"


@CPU_ONLY
@pytest.mark.timeout(120)
def test_fp16_is_refused_on_a_cpu_by_every_rank(tmp_path: Path) -> None:
    one = _one_process(tmp_path, "--mixed-precision", "fp16")
    line = f"benchmark.py: error: {FIX} (see benchmark.py --help)"
    assert one.returncode == 2 and one.stderr.strip() == line
    assert not (tmp_path / "bench").exists()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", str(REPO / "scripts" / "benchmark.py"),
        "--mixed-precision", "fp16", "--out", str(tmp_path / "bench"),
    ]  # fmt: skip
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=_env(tmp_path))
    assert two.returncode != 0 and "exitcode  : 2" in two.stderr  # a rank's own exit, not a hang
    # every rank refuses by itself; the first of the launch says why, once, and the launcher's
    # report repeats it as its root cause at the end
    assert two.stderr.count(line) == 2 and f"traceback : {line}" in two.stderr
    assert "init_process_group" not in two.stderr and "Gloo" not in two.stderr


@CPU_ONLY
def test_dspzoo_bench_passes_the_flag_on_and_refuses_fp16_on_a_cpu(capsys) -> None:
    from dspzoo.zoo.cli import main

    assert main(["bench", "-n", "2", "--mixed-precision", "bf16", "--", "--reps", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert "--mixed_precision no" in line  # Accelerate's stays off: the script autocasts
    assert line.endswith("scripts/benchmark.py --reps 1 --mixed-precision bf16")
    assert main(["bench", "-n", "2", "--mixed-precision", "fp16"]) == 0  # printed: for a GPU
    assert capsys.readouterr().out.strip().endswith("--mixed-precision fp16")
    for argv in (
        ["bench", "-n", "2", "--mixed-precision", "fp16", "--run"],
        ["bench", "--run", "--", "--mixed-precision", "fp16"],
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == f"dspzoo bench: error: {FIX} (see dspzoo bench --help)"
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--mixed-precision", "bf16", "--", "--mixed-precision=fp16"])
    assert refused.value.code == 2 and "give it once" in capsys.readouterr().err


@CUDA
def test_the_fp16_reference_scales_its_loss_on_cuda() -> None:
    """On a GPU the fp16 one-process reference takes a loss scale, which keeps its gradients
    from underflowing: it lies within fp16's rounding of the fp32 step, not O(1) from it (0.97
    unscaled on an H200), and the check's tolerance stays a real one."""
    case = build_case(build_parser().parse_args([*TINY, "--mixed-precision", "fp16"]), 1)
    case = case.to(torch.device("cuda"))
    reference = one_process_reference(case, case.inputs)
    assert reference.loss_scale > 1
    assert reference.rounding < 0.05, reference.rounding
    assert reference.rtol < MAX_RTOL


def test_the_peer_counter_sums_its_dtype_split() -> None:
    """The DeepSpeed peer's byte counter (no DeepSpeed needed): bytes by (phase, dtype), and
    their total, the one figure the report adds to the traced bytes."""
    from dspzoo.core.bench.peer import _Counter

    counter = _Counter()
    counter.add(torch.zeros(2, dtype=torch.bfloat16), 10)
    counter.phase = "backward"
    counter.add(torch.zeros(2), 7)
    counter.add(torch.zeros(2), 5)
    assert counter.by_dtype == {("forward", "bfloat16"): 10, ("backward", "float32"): 12}
    assert counter.total == 22


def _scaled_traced_steps(rank: int, world: int) -> dict:
    """A worker: each strategy's traced step at SP 2 against a bf16 reference whose loss scale
    is set to 2^10 (as an fp16 reference's would be), with the gradients it reports."""
    from dspzoo.core.bench.meshes import MeshCache
    from dspzoo.core.bench.runner import Runner

    case = build_case(build_parser().parse_args([*TINY, "--mixed-precision", "bf16"]), 1)
    meshes = MeshCache()
    found = {}
    for name in ("dsp", "ring", "megatron_sp"):
        runner = Runner(name, case, world, meshes)
        reference = one_process_reference(case, runner.inputs)
        reference.loss_scale = 2.0**10
        agreement = runner.traced_step(reference)["agreement"]
        found[name] = {k: agreement[k] for k in ("ok", "loss_scale", "finite", "grad_error")}
    return found


@pytest.mark.timeout(200)
def test_the_sharded_traced_step_unscales_its_gradients() -> None:
    """At SP 2 the traced step takes the reference's loss scale halved (its activation
    gradients are twice the reference's under the gradient contract) and divides the
    gradients by it again: DDP-free DSP, ring and Megatron-SP's tensor-parallel path still
    agree with one process."""
    from dspzoo.core.testing import run_distributed

    for by_rank in run_distributed(_scaled_traced_steps, 2, timeout=180):
        for name, got in by_rank.items():
            assert got["loss_scale"] == 2.0**9 and got["finite"], (name, got)
            assert got["ok"], (name, got)

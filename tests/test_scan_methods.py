"""The scan methods (issue 18): state passing and the head all-to-all run a Mamba mixer over a
sharded sequence exactly, and DSP's axial plan runs it with no communication inside.

Every mixer (Mamba-1 / Mamba-2, one direction / bidirectional) × method × SP 2, 3, 4 on lengths
no SP size divides (down to one token per rank, so the conv halo needs several hops): the
output and every parameter gradient equal one process, and every rank's traced bytes equal the
cost model's (:func:`comm_bytes`, which reads the registry's :meth:`Method.scan_bytes`). Bad input raises on every rank. One spawn of 4
gloo workers runs every case (groups of 2, 3 and 4 ranks reused).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dspzoo.core.costmodel.formulas import comm_bytes
from dspzoo.core.costmodel.workload import StageSpec, Workload
from dspzoo.core.harness import full_gradients, relative_error
from dspzoo.core.layers.mamba import (
    Mamba1Config,
    Mamba1Mixer,
    Mamba2Config,
    Mamba2Mixer,
    scan_along,
)
from dspzoo.core.parallel import context
from dspzoo.core.parallel.comm import CollectiveInputError
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.methods.registry import get_method, methods_for
from dspzoo.core.parallel.methods.scan import halo_hops
from dspzoo.core.parallel.plan import Stage, plan_fixed, plan_stages
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.core.testing import run_distributed

HIDDEN, BATCH = 8, 2
SCAN_METHODS = ("state_passing", "head_a2a")
LENGTHS = {2: (7,), 3: (7,), 4: (5, 7)}  # 5 at SP 4: shards [2, 1, 1, 1], a 3-hop halo
TOLERANCE = 1e-9  # fp64 throughout


def make_mixer(kind: str) -> nn.Module:
    """Tiny mixers: Mamba-1 (16 channels), Mamba-2 (4 heads of 4, 2 groups of B/C)."""
    bidirectional = kind.endswith("_bi")
    if kind.startswith("mamba1"):
        cfg = Mamba1Config(hidden_size=HIDDEN, state_size=4, bidirectional=bidirectional)
        return Mamba1Mixer(cfg).double()
    cfg2 = Mamba2Config(
        hidden_size=HIDDEN,
        num_heads=4,
        head_dim=4,
        state_size=4,
        n_groups=2,
        chunk_size=3,
        bidirectional=bidirectional,
    )
    return Mamba2Mixer(cfg2).double()


MIXERS = ("mamba1", "mamba1_bi", "mamba2", "mamba2_bi")


class ScanModel(nn.Module):
    """``[B, *dims, C]`` → a residual scan over ``over`` (one stage), as a model writes it."""

    def __init__(self, kind: str, names: tuple[str, ...], over: tuple[str, ...], method=None):
        super().__init__()
        self.mixer = make_mixer(kind)
        self.names, self.over = names, over
        self.stages = (Stage("scan", over, method=method, op="scan"),)

    def forward(self, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
        act = sp.enter(x, self.names, self.stages)
        with sp.region(act) as region:
            h = context.stage("scan", act.tensor)
            h = h + scan_along(self.mixer, h, self.over)
            act = region.seq(h)
        return sp.exit(act)


def _weights(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(model: nn.Module, x: torch.Tensor, sp: SeqParallel, seed: int) -> torch.Tensor:
    out = model(x, sp)
    (out * _weights(out.shape, seed)).sum().backward()
    return out.detach()


def _traced(tracer) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for rec in tracer.records:
        entry = out.setdefault((rec.op, rec.phase), [0, 0])
        entry[0] += 1
        entry[1] += rec.bytes_sent
    return {k: tuple(v) for k, v in out.items()}


def _workload(model: ScanModel, names, lengths, over) -> Workload:
    """The cost model's view of ``ScanModel``: one scan stage, the exit gather."""
    spec = StageSpec(model.stages[0], scan_over=over, scan=model.mixer.scan_shape(1, ()))
    return Workload(
        name="scan_stage", family="test", batch=BATCH, dims=names, lengths=lengths,
        hidden=HIDDEN, heads=1, kv_heads=1, mlp_hidden=0, layers=((spec,),),
        period=model.stages, in_width=HIDDEN, exit_width=HIDDEN, itemsize=8,
    )  # fmt: skip


def _case(
    mesh: SPMesh, kind: str, method: str | None, names, lengths, over, seed: int
) -> list[str]:
    """One model × method at one SP size: outputs, gradients and bytes against one process."""
    x = _weights(torch.Size((BATCH, *lengths, HIDDEN)), seed + 1)
    torch.manual_seed(seed)
    ref_model = ScanModel(kind, names, over, method)
    ref = _run(ref_model, x, SeqParallel(), seed)
    torch.manual_seed(seed)
    model = ScanModel(kind, names, over, method)
    sp = SeqParallel(mesh)
    with trace_comm() as tracer:
        out = _run(model, x, sp, seed)
    grads = full_gradients(model, sp, mesh, False)
    where = f"{kind} {method or 'dsp'} SP {mesh.sp_size} lengths {lengths} rank {mesh.sp_rank}"
    failures = []
    if relative_error(out, ref) > TOLERANCE:
        failures.append(f"{where}: output error {relative_error(out, ref):.2e}")
    for name, p in ref_model.named_parameters():
        err = relative_error(grads[name], p.grad)
        if err > TOLERANCE:
            failures.append(f"{where}: gradient of {name} error {err:.2e}")
    workload = _workload(model, names, lengths, over)
    plan = sp.plan(names, lengths, model.stages)
    want = comm_bytes(workload, plan, mesh.sp_size, mesh.sp_rank)
    expected = {k: tuple(v) for k, v in want.items() if v != [0, 0]}
    traced = _traced(tracer)
    if traced != expected:
        failures.append(f"{where}: traced {traced} != formula {expected}")
    return failures


def _bad_inputs(mesh: SPMesh) -> list[str]:
    """A wrong shard on the last rank, and a stage planned with a scan method that never
    scans: every rank raises."""
    failures = []
    n, r = mesh.sp_size, mesh.sp_rank
    mixer = make_mixer("mamba2")
    seq = shard_sizes(7, n)
    wrong = seq[r] + (1 if r == n - 1 else 0)
    sp = SeqParallel(mesh)
    for method in SCAN_METHODS:
        try:
            get_method(method).scan(sp, mixer, torch.zeros(BATCH, wrong, HIDDEN).double(), seq)
            failures.append(f"rank {r}: {method} accepted a wrong shard")
        except CollectiveInputError as exc:
            if f"rank {n - 1}" not in str(exc) or "tokens" not in str(exc):
                failures.append(f"rank {r}: unclear error {exc}")
    model = ScanModel("mamba1", ("l",), ("l",), "state_passing")
    model.forward = lambda x, sp: _skips_scan(model, x, sp)  # type: ignore[method-assign]
    try:
        model(torch.zeros(BATCH, 7, HIDDEN).double(), sp)
        failures.append(f"rank {r}: a stage that never called sp.scan passed")
    except RuntimeError as exc:
        if "sp.scan" not in str(exc):
            failures.append(f"rank {r}: unclear error {exc}")
    return failures


def _skips_scan(model: ScanModel, x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    act = sp.enter(x, model.names, model.stages)
    with sp.region(act) as region:
        h = context.stage("scan", act.tensor)
        act = region.seq(h * 2)  # token-wise only: the planned state passing never ran
    return sp.exit(act)


def _worker(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    meshes: dict[int, SPMesh | None] = {}
    for n in (2, 3, 4):
        group = dist.group.WORLD if n == world else dist.new_group(list(range(n)))
        meshes[n] = SPMesh(world, rank, 1, n, 0, rank, sp_group=group) if rank < n else None
    waiting = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=240))
    failures: list[str] = []
    for n in (2, 3, 4):
        mesh = meshes[n]
        if mesh is not None:
            seed = 1000 * n  # the same on every rank of the group
            for length in LENGTHS[n]:
                for kind in MIXERS:
                    for method in SCAN_METHODS:
                        seed += 10
                        failures += _case(mesh, kind, method, ("l",), (length,), ("l",), seed)
            # a raster over (t, s) with t sharded (state passing), and DSP's axial scan over s
            for kind in ("mamba1_bi", "mamba2"):
                seed += 10
                failures += _case(mesh, kind, "state_passing", ("t", "s"), (5, 3), ("t", "s"), seed)
                seed += 10
                failures += _case(mesh, kind, None, ("t", "s"), (5, 3), ("s",), seed)
            failures += _bad_inputs(mesh)
        dist.barrier(group=waiting)
    return failures


@pytest.mark.timeout(600)
def test_scan_methods_equal_one_process_with_formula_bytes_at_sp_2_3_4() -> None:
    results = run_distributed(_worker, 4, timeout=580)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


def test_scan_op_kind_and_its_methods_are_registered() -> None:
    assert {m.name for m in methods_for("scan", hybrid=True)} == set(SCAN_METHODS)
    for name in SCAN_METHODS:
        method = get_method(name)
        assert method.entry == "sp.scan" and method.runs("scan") and not method.runs("attention")
    assert get_method("head_a2a").unsupported(4, heads=2)
    assert not get_method("state_passing").unsupported(4, heads=2)
    # a scan over every dim of a 1-D sequence gets a scan method; an axial scan is local
    plan = plan_stages(("l",), (64,), (Stage("scan", ("l",), op="scan"),), 4)
    assert plan.method_for("scan") in SCAN_METHODS
    plan = plan_stages(("t", "s"), (8, 8), (Stage("a", ("t",), op="scan"),), 4)
    assert plan.method_for("a") == "local" and plan.sharded_for("a") == "s"
    forced = Stage("scan", ("l",), method="head_a2a", op="scan", heads=2)
    assert plan_stages(("l",), (64,), (forced,), 2).method_for("scan") == "head_a2a"
    with pytest.raises(ValueError, match="does not run"):
        Stage("attn", ("l",), method="state_passing")
    # a hybrid LM: attention by an attention method, the scan by a scan method, in one plan
    hybrid = (Stage("attn", ("l",)), Stage("scan", ("l",), op="scan"), Stage("mlp"))
    dsp = plan_stages(("l",), (64,), hybrid, 4)
    assert dsp.method_for("attn") in ("ulysses", "ring") and dsp.method_for("scan") in SCAN_METHODS
    lss = plan_fixed(("l",), (64,), hybrid, 4, "lss")
    assert lss.method_for("attn") == "lss" and lss.method_for("scan") in SCAN_METHODS
    # a raster scan is planned with its outermost dim sharded only
    raster = plan_stages(("t", "s"), (5, 9), (Stage("r", ("t", "s"), op="scan"),), 2)
    assert raster.sharded_for("r") == "t" and raster.method_for("r") in SCAN_METHODS


def test_a_scan_over_a_dim_the_activation_lacks_is_refused() -> None:
    x = torch.zeros(BATCH, 5, 3, HIDDEN).double()
    for over in (("h",), (), ("t", "t")):
        model = ScanModel("mamba2", ("t", "s"), ("t",))
        model.over = over
        with pytest.raises(ValueError, match="unknown|name the dims"):
            model(x, SeqParallel())


def test_halo_hops() -> None:
    assert halo_hops([4, 3], 3) == 1
    assert halo_hops([2, 1, 1, 1], 3) == 3
    assert halo_hops([2, 2, 2, 1], 3) == 2
    assert halo_hops([5, 5], 0) == 0

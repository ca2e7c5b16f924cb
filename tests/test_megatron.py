"""megatron_sp (Megatron-LM tensor parallelism + sequence parallelism) equals one process.

An N-rank step (dp 1 × sp N at N = 2, 3, 4, and dp 2 × sp 2) on the toy model and STDiT-tiny
(with a full 3-D attention layer), heads not divisible by 3, sequence lengths not divisible by
N, in float64: the forward output and every parameter gradient (shards gathered, after
``megatron_grad_sync``) equal the single-process ones. Traced bytes per layer follow
Megatron-SP's formula: per linear pair one all-gather and one reduce-scatter of the activation
``M``, ``(N−1)/N·M`` elements per rank each way (padded to the longest shard when uneven).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dspzoo.domains.video  # noqa: F401  (registers the families)
from dspzoo.core import SeqParallel, build_mesh, sp_mse, trace_comm
from dspzoo.core.layers.attention import SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp
from dspzoo.core.parallel.layout import SeqSpec, shard_sizes
from dspzoo.core.parallel.methods.megatron import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full,
    megatron_grad_sync,
    parallelize_megatron,
    shard_index,
)
from dspzoo.core.parallel.plan import Stage, plan_fixed
from dspzoo.core.parallel.strategies import STRATEGIES, get_strategy
from dspzoo.core.testing import run_distributed
from dspzoo.domains.toy.model import Toy2DConfig, Toy2DTransformer
from dspzoo.zoo import create_model

TOY = Toy2DConfig(in_channels=3, hidden=20, heads=5, depth=2, mlp_ratio=2.0)
TOL = {"rtol": 1e-9, "atol": 1e-11}


# -- single process ----------------------------------------------------------------------------
def test_registered_and_planned_on_every_stage() -> None:
    assert "megatron_sp" in STRATEGIES
    stages = (Stage("spatial", ("s",)), Stage("temporal", ("t",)), Stage("cross"), Stage("mlp"))
    plan = get_strategy("megatron_sp").plan(("t", "s"), (5, 9), stages, 4)
    assert plan.methods == dict.fromkeys(("spatial", "temporal", "cross", "mlp"), "megatron_sp")
    assert {s.sharded for s in plan.steps} == {"s"} and plan.switches_per_period == 0
    plan_t = plan_fixed(("t", "s"), (5, 9), stages, 4, "megatron_sp", dim="t")
    assert {s.sharded for s in plan_t.steps} == {"t"}


def test_shard_index_stacks_heads_per_group() -> None:
    # 3 groups (q, k, v) of 5 heads of 2 features, over 3 ranks: heads 2, 2, 1
    got = [shard_index(30, 3, 5, 3, r).tolist() for r in range(3)]
    assert got[0] == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    assert got[2] == [8, 9, 18, 19, 28, 29]
    assert sorted(sum(got, [])) == list(range(30))
    with pytest.raises(ValueError, match="equal units"):
        shard_index(30, 3, 4, 2, 0)


def test_hooks_are_identity_under_other_strategies_and_one_rank() -> None:
    torch.manual_seed(0)
    model = Toy2DTransformer(TOY).double()
    x = torch.randn(2, 5, 7, TOY.in_channels, dtype=torch.float64)
    ref = model(x)
    torch.testing.assert_close(model(x, SeqParallel(None, "megatron_sp")), ref)
    # at one rank the shards are whole: the parallelized model is the same function
    parallelize_megatron(model, None)
    assert isinstance(model.blocks[0].spatial.qkv, ColumnParallelLinear)
    assert isinstance(model.blocks[0].mlp[3], RowParallelLinear)
    torch.testing.assert_close(model(x, SeqParallel(None, "megatron_sp")), ref)
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_megatron(model, None)


def test_row_parallel_shard_refuses_a_direct_call() -> None:
    attn = SeqSelfAttention(8, 2, over="s")
    row = RowParallelLinear(4, 8)
    row.tp_size = 2
    attn.proj = row
    with pytest.raises(RuntimeError, match="tp_exit"):
        row(torch.randn(3, 4))
    mlp = Mlp(8, 2.0)
    out = mlp(torch.randn(3, 8))  # no SP context: a plain MLP
    assert out.shape == (3, 8)


# -- distributed -------------------------------------------------------------------------------
def _toy_data(dp: int, t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(dp, 2, t, s, TOY.in_channels, generator=g, dtype=torch.float64)
    y = torch.randn(dp, 2, t, s, TOY.in_channels, generator=g, dtype=torch.float64)
    return x, y


def _toy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Toy2DTransformer(TOY).double()


def _stdit_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(
        "stdit-tiny", hidden=32, heads=4, depth=2, full_attention_every=2, num_classes=3, cond_dim=0
    ).double()
    with torch.no_grad():  # leave adaLN-Zero's identity start: every gradient non-trivial
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _stdit_data(dp: int) -> tuple[list[dict], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    inputs = [
        {
            "x": torch.randn(2, 12, 5, 6, 6, generator=g, dtype=torch.float64),
            "timestep": torch.rand(2, generator=g, dtype=torch.float64) * 1000,
            "y": torch.tensor([0, 2]),
        }
        for _ in range(dp)
    ]
    weight = torch.randn(dp, 2, 12, 5, 6, 6, generator=g, dtype=torch.float64)
    return inputs, weight


def _reference(family: str, dp: int, t: int, s: int, sharded_loss: bool):
    """Single-process outputs per DP replica and the DP-mean gradient."""
    model = _toy_model() if family == "toy" else _stdit_model()
    outs, grads = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for d in range(dp):
        model.zero_grad()
        out, loss = _loss(family, model, None, d, dp, t, s, sharded_loss)
        loss.backward()
        outs.append(out.detach())
        for n, p in model.named_parameters():
            grads[n] += p.grad / dp
    return outs, grads


def _loss(family, model, sp, d, dp, t, s, sharded_loss):
    """(replicated output, this rank's loss) for DP replica ``d``."""
    if family == "toy":
        x, y = _toy_data(dp, t, s)
        if sharded_loss and sp is not None:
            out = model(x[d], sp, gather_output=False)
            return sp.exit(out), sp_mse(out.tensor, sp.shard_like(y[d], out), sp.group)
        out = model(x[d], sp)
        return out, torch.nn.functional.mse_loss(out, y[d])
    inputs, weight = _stdit_data(dp)
    out = model(**inputs[d], sp=sp)
    return out, ((out - weight[d]) ** 2).mean()


def _megatron_case(mesh, family: str, t: int, s: int, sharded_loss: bool, dim=None) -> dict:
    """One megatron_sp step on ``mesh``; checks output and gradients, returns traced bytes."""
    sp = SeqParallel(mesh, "megatron_sp", dim=dim)
    what = f"{family} dp{mesh.dp_size}×sp{mesh.sp_size} t={t} s={s} dim={dim}"
    model = _toy_model() if family == "toy" else _stdit_model()
    full_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_megatron(model, sp.group)
    for name, p in gather_full(model, sp.group).items():  # the shards tile the full model
        torch.testing.assert_close(p, full_params[name], rtol=0, atol=0, msg=f"{what} {name}")
    with trace_comm() as tracer:
        out, loss = _loss(family, model, sp, mesh.dp_rank, mesh.dp_size, t, s, sharded_loss)
        loss.backward()
    megatron_grad_sync(model, mesh)
    ref_outs, ref_grads = _reference(family, mesh.dp_size, t, s, sharded_loss)
    torch.testing.assert_close(out, ref_outs[mesh.dp_rank], **TOL, msg=what)
    grads = gather_full(model, sp.group, grads=True)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=f"{what} {name}")
    return {
        (op, phase): (tracer.count(op, phase, "block0/"), tracer.total_bytes(op, phase, "block0/"))
        for op in ("all_gather", "reduce_scatter", "all_to_all")
        for phase in ("forward", "backward")
    }


def _expected_bytes(n: int, rows: int, row_elems: int, pairs: int) -> tuple[int, int]:
    """(count, bytes) per rank of ``pairs`` all-gathers of an activation of ``rows`` rows."""
    padded = max(shard_sizes(rows, n))  # = rows / n when n divides rows
    return pairs, pairs * (n - 1) * padded * row_elems * 8


def _check_bytes(traced: dict, n: int, rows: int, row_elems: int, pairs: int) -> None:
    want = _expected_bytes(n, rows, row_elems, pairs)
    for key in (
        ("all_gather", "forward"),
        ("reduce_scatter", "forward"),
        ("reduce_scatter", "backward"),
        ("all_gather", "backward"),
    ):
        assert traced[key] == want, (key, traced[key], want)
    assert traced[("all_to_all", "forward")] == (0, 0)
    assert traced[("all_to_all", "backward")] == (0, 0)


def _world_checks(rank: int, world: int) -> None:
    meshes = [build_mesh(world)]
    if world == 4:
        meshes.append(build_mesh(2))  # dp 2 × sp 2
    for mesh in meshes:
        n = mesh.sp_size
        # toy: sharded on s (7, divisible by none of 2, 3, 4), heads 5, loss both ways
        _megatron_case(mesh, "toy", 5, 7, sharded_loss=False)
        _megatron_case(mesh, "toy", 5, 7, sharded_loss=True, dim="t")
        if n == 4:  # t = 3 < 4: an idle rank (a zero-row shard) in every collective
            _megatron_case(mesh, "toy", 3, 7, sharded_loss=True, dim="t")
        # STDiT-tiny: T' = 5, S = 9, heads 4, a full (t, s) attention layer, both dims
        for dim in (None, "t"):
            _megatron_case(mesh, "stdit", 5, 9, sharded_loss=False, dim=dim)
        # bytes: a length N divides (the exact (N−1)/N·M) and one it does not (padded)
        b, c = 2, TOY.hidden
        for t, s in ((3, 12), (3, 7)):
            traced = _megatron_case(mesh, "toy", t, s, sharded_loss=False)
            _check_bytes(traced, n, s, b * t * c, pairs=3)  # spatial, temporal, mlp
            if s % n == 0:
                m = b * t * s * c
                assert traced[("all_gather", "forward")][1] == 3 * (n - 1) * m // n * 8
        # STDiT: per layer spatial, temporal, mlp pairs (axial layer block0)
        traced = _megatron_case(mesh, "stdit", 5, 9, sharded_loss=False)
        _check_bytes(traced, n, 9, 2 * 5 * 32, pairs=3)
    # clear errors: fewer heads than ranks, and an unparallelized model under megatron_sp
    if world >= 3:
        mesh = meshes[0]
        attn = SeqSelfAttention(8, 2, over="s")
        try:
            parallelize_megatron(attn, mesh.sp_group)
        except ValueError as exc:
            assert "2 heads, fewer than the" in str(exc), exc
        else:
            raise AssertionError("heads < N was accepted")
    sp = SeqParallel(meshes[0], "megatron_sp")
    try:
        _toy_model()(torch.randn(1, 3, 8, TOY.in_channels, dtype=torch.float64), sp)
    except TypeError as exc:
        assert "parallelize_megatron" in str(exc), exc
    else:
        raise AssertionError("an unparallelized model ran under megatron_sp")
    dist.barrier()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_megatron_sp_matches_one_process(world: int) -> None:
    run_distributed(_world_checks, world, timeout=280)


def test_spec_roundtrip_of_the_hooks_without_megatron() -> None:
    sp = SeqParallel(None, "dsp")
    x = torch.randn(2, 3, 4, 8)
    spec = SeqSpec.of(x, ("t", "s")).with_sharded("s")
    got, inner = sp.tp_enter(x, spec)
    assert got is x and inner is spec
    linear = torch.nn.Linear(8, 8)
    torch.testing.assert_close(sp.tp_exit(linear, x, spec), linear(x))

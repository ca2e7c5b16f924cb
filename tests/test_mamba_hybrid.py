"""The hybrid Mamba + attention LM (issue 18): one model whose plan runs its scan stages with a
scan method and its attention stages with an attention method, exact.

At SP 2, 3 and 4 on lengths no SP size divides, under ``dsp`` (the planner's own choice per
stage) and under fixed strategies that mix methods (scans by state passing with attention by
Ulysses, LSS or Ring; scans by the head all-to-all with attention by Ring or LSS), the logits
and every parameter gradient equal one process (fp64) and every rank's traced bytes equal the
cost model's (:func:`comm_bytes` over :func:`hybrid_lm_workload`, which reads the registry's
formulas). One spawn of 4 gloo workers runs every case (groups of 2, 3 and 4 ranks reused).
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dspzoo.core.costmodel.formulas import comm_bytes
from dspzoo.core.harness import full_gradients, relative_error
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.mesh import SPMesh
from dspzoo.core.parallel.methods.lss_offload import lss_offloads
from dspzoo.core.parallel.plan import plan_fixed, plan_stages
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.core.testing import run_distributed
from dspzoo.domains.mamba import HYBRID_CONFIGS, HybridLM, HybridLMConfig, hybrid_stages
from dspzoo.domains.mamba.hybrid import SEQ_DIMS, AttentionLayer
from dspzoo.domains.mamba.lm import MambaLMBlock
from dspzoo.domains.mamba.workload import hybrid_lm_workload

BATCH, VOCAB = 2, 32
TOLERANCE = 1e-9  # fp64 throughout
# Mamba-2 layers 0 and 2 (4 heads, 2 groups of B/C, chunks of 3), attention layers 1 and 3
# (4 query heads over 2 K/V heads, rotary positions)
MAMBA2 = HybridLMConfig(
    version=2, vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, state_size=4,
    num_heads=4, head_dim=8, n_groups=2, chunk_size=3, attn_layer_period=2,
    attn_layer_offset=1, num_attention_heads=4, num_key_value_heads=2, mlp_ratio=2.0, rope=True,
    tie_word_embeddings=False,
)  # fmt: skip
MAMBA1 = replace(MAMBA2, version=1, num_hidden_layers=3, attn_layer_period=3)  # scan attn scan
LENGTHS = {2: 7, 3: 7, 4: 6}  # 6 at SP 4: shards [2, 2, 1, 1], a two-hop conv halo
# lss_balanced lends no query rows at 7 over 3 ranks or 6 over 4: lengths at which it does
LENDING_LENGTHS = {2: 7, 3: 11, 4: 10}
# (config, strategy, forced scan method, forced attention method): what each case runs
CASES = (
    (MAMBA2, "dsp", None, None),  # the planner's choice: state passing + Ulysses / Ring
    (MAMBA2, "ulysses", None, None),  # attention by the strategy, scans by their cheapest
    (MAMBA2, "lss", None, None),
    (MAMBA2, "ring", None, None),
    (MAMBA2, "ring", "head_a2a", None),  # scans by the head all-to-all, attention by Ring
    (MAMBA2, "ring_balanced", None, None),  # causal work balanced on the scans' contiguous shards
    (MAMBA2, "lss_balanced", None, None),  # the same, by lending query rows
    (MAMBA2, "dsp", "head_a2a", "lss"),
    (MAMBA1, "dsp", None, None),  # Mamba-1: 32 channels for the head all-to-all
    (MAMBA1, "ulysses", "head_a2a", None),
)


def _plan_methods(config: HybridLMConfig, strategy: str, n: int, length: int) -> dict[str, str]:
    stages = hybrid_stages(config)
    if strategy == "dsp":
        return plan_stages(SEQ_DIMS, (length,), stages, n).methods
    return plan_fixed(SEQ_DIMS, (length,), stages, n, strategy).methods


def _weights(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _model(config: HybridLMConfig, seed: int) -> HybridLM:
    """The model in fp64 with every parameter moved off its init (same on every rank)."""
    torch.manual_seed(seed)
    model = HybridLM(config).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def _run(model: HybridLM, tokens: torch.Tensor, sp: SeqParallel, seed: int) -> torch.Tensor:
    out = model(tokens, sp)
    (out * _weights(out.shape, seed)).sum().backward()
    return out.detach()


def _traced(tracer) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for rec in tracer.records:
        entry = out.setdefault((rec.op, rec.phase), [0, 0])
        entry[0] += 1
        entry[1] += rec.bytes_sent
    return {k: tuple(v) for k, v in out.items()}


def _case(mesh: SPMesh, case: tuple, length: int, seed: int) -> list[str]:
    """One config × strategy × forced methods at one SP size against one process."""
    config, strategy, scan_method, attention_method = case
    config = replace(config, scan_method=scan_method, attention_method=attention_method)
    tokens = torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))
    ref_model = _model(config, seed)
    ref = _run(ref_model, tokens, SeqParallel(), seed)
    model = _model(config, seed)
    sp = SeqParallel(mesh, strategy)
    with trace_comm() as tracer:
        out = _run(model, tokens, sp, seed)
    grads = full_gradients(model, sp, mesh, False)
    plan = sp.plan(SEQ_DIMS, (length,), model.stages)
    methods = "/".join(plan.methods[s.name] for s in model.stages)
    where = (
        f"mamba{config.version} {strategy} ({methods}) SP {mesh.sp_size} L={length} "
        f"rank {mesh.sp_rank}"
    )
    failures = []
    if relative_error(out, ref) > TOLERANCE:
        failures.append(f"{where}: output error {relative_error(out, ref):.2e}")
    for name, p in ref_model.named_parameters():
        err = relative_error(grads[name], p.grad)
        if err > TOLERANCE:
            failures.append(f"{where}: gradient of {name} error {err:.2e}")
    workload = hybrid_lm_workload("hybridlm", config, batch=BATCH, seq_len=length, itemsize=8)
    want = comm_bytes(workload, plan, mesh.sp_size, mesh.sp_rank)
    expected = {k: tuple(v) for k, v in want.items() if v != [0, 0]}
    traced = _traced(tracer)
    if traced != expected:
        failures.append(f"{where}: traced {traced} != formula {expected}")
    if scan_method and plan.method_for("scan") != scan_method:
        failures.append(f"{where}: the forced scan method {scan_method} was not planned")
    return failures


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
            for i, case in enumerate(CASES):
                length = (LENDING_LENGTHS if case[1] == "lss_balanced" else LENGTHS)[n]
                failures += _case(mesh, case, length, 100 * n + i)
        dist.barrier(group=waiting)
    return failures


@pytest.mark.timeout(300)
def test_hybrid_lm_equals_one_process_with_formula_bytes_at_sp_2_3_4() -> None:
    results = run_distributed(_worker, 4, timeout=280)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


def test_the_cases_mix_methods_per_stage() -> None:
    """Every case runs its scans and its attention with different methods, and together the
    cases run every scan method beside every attention method of the list."""
    seen = set()
    for n in (2, 3, 4):
        for config, strategy, scan, attention in CASES:
            config = replace(config, scan_method=scan, attention_method=attention)
            methods = _plan_methods(config, strategy, n, LENGTHS[n])
            assert methods["mlp"] == "local"
            assert methods["scan"] in ("state_passing", "head_a2a")
            assert methods["attn"] in ("ulysses", "ring", "ring_balanced", "lss", "lss_balanced")
            seen.add((methods["scan"], methods["attn"]))
    assert {("state_passing", a) for a in ("ulysses", "ring", "lss")} <= seen
    assert {("head_a2a", "ring"), ("head_a2a", "lss"), ("head_a2a", "ulysses")} <= seen


def test_dsp_plans_a_scan_method_and_an_attention_method() -> None:
    """DSP's plan of the hybrid: state passing for the scans (its bytes do not grow with the
    sequence), Ulysses for the attention while there are at least as many heads as ranks, the
    balanced ring (causal attention) when there are fewer; the MLP local; no switch (one dim)."""
    for n in (2, 3, 4):
        plan = plan_stages(SEQ_DIMS, (4096,), hybrid_stages(MAMBA2), n)
        assert plan.methods == {"scan": "state_passing", "attn": "ulysses", "mlp": "local"}
        assert plan.switches_per_period == 0
    two_heads = replace(MAMBA2, num_attention_heads=2, num_key_value_heads=None)
    for n in (3, 4):
        plan = plan_stages(SEQ_DIMS, (4096,), hybrid_stages(two_heads), n)
        assert plan.methods == {"scan": "state_passing", "attn": "ring_balanced", "mlp": "local"}
    # a forced scan method on a Mamba-2 with fewer heads than ranks is refused by the planner
    few = replace(MAMBA2, scan_method="head_a2a")
    stages = hybrid_stages(few)
    assert stages[0].heads == 4 and stages[0].method == "head_a2a"


def test_layers_alternate_as_configured() -> None:
    model = HybridLM(replace(MAMBA2, num_hidden_layers=6, attn_layer_period=3, attn_layer_offset=2))
    kinds = [type(layer) for layer in model.backbone.layers]
    assert kinds == [MambaLMBlock, MambaLMBlock, AttentionLayer] * 2
    names = {n.split(".")[3] for n, _ in model.named_parameters() if n.startswith("backbone.lay")}
    assert names == {"norm", "mixer", "attn", "mlp"}
    only_mamba = HybridLM(replace(MAMBA2, num_hidden_layers=1, attn_layer_offset=1))
    assert [s.name for s in only_mamba.stages] == ["scan"]


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    tokens = torch.randint(0, VOCAB, (BATCH, 9), generator=torch.Generator().manual_seed(3))
    plain = _model(MAMBA2, 5)
    recomputed = _model(replace(MAMBA2, checkpoint=True), 5)
    for model in (plain, recomputed):
        _run(model, tokens, SeqParallel(), 5)
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters()):
        assert relative_error(q.grad, p.grad) < TOLERANCE, name


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="scan_method='ulysses' is not a method that runs 'scan'"):
        HybridLMConfig(scan_method="ulysses")
    with pytest.raises(ValueError, match="attention_method='state_passing'"):
        HybridLMConfig(attention_method="state_passing")
    with pytest.raises(ValueError, match="unknown method 'tree'"):
        HybridLMConfig(scan_method="tree")
    with pytest.raises(ValueError, match="attn_layer_offset < attn_layer_period"):
        HybridLMConfig(attn_layer_period=2, attn_layer_offset=2)
    with pytest.raises(ValueError, match="not divisible by 3 heads"):
        HybridLMConfig(hidden_size=64, num_attention_heads=3)


def test_zoo_configs() -> None:
    """tiny/small build and run; the published-scale config is described on the meta device."""
    from dspzoo.zoo import create_model

    model = create_model("hybridlm-tiny")
    assert isinstance(model, HybridLM) and model.config == HYBRID_CONFIGS["tiny"]
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)
    with torch.device("meta"):
        big = create_model("hybridlm-130m")
    assert big.config.attention_layers == (5, 11, 17, 23)
    assert 1.3e8 < sum(p.numel() for p in big.parameters()) < 1.6e8


def test_the_lss_balanced_case_lends_rows_at_every_sp_size() -> None:
    """The lss_balanced case runs at lengths where its later ranks lend query rows (else it
    would run plain LSS and test nothing of its own)."""
    for n, length in LENDING_LENGTHS.items():
        assert lss_offloads(shard_sizes(length, n)), (n, length)

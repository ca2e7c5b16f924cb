"""The harness's verdicts: ok, FAIL (a wrong answer or a run that raised), and "not runnable:
<reason>" for a strategy the model cannot run at an SP size (from the method registry and the
tensor-parallel contract), plus the contract's clear message for a ``TP_PLAN`` module whose head
count is not called ``heads`` (which otherwise fails deep in the forward as an ``EinopsError``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dspzoo.core.harness import check_model, model_heads, not_runnable
from dspzoo.core.layers.mlp import Mlp
from dspzoo.core.parallel.methods.registry import get_method
from dspzoo.core.parallel.tp_contract import TPContractError, check_tp_contract, tp_units
from dspzoo.examples.axial3d import Axial3D, Axial3DConfig, AxialAttention

TWO_HEADS = Axial3DConfig(patch=2, hidden=8, heads=2, depth=1, max_frames=8, max_side=8)
FOUR_HEADS = Axial3DConfig(patch=2, hidden=16, heads=4, depth=1, max_frames=8, max_side=8)


def make_two_head_model() -> nn.Module:
    return Axial3D(TWO_HEADS)


def make_inputs() -> dict[str, torch.Tensor]:  # tokens t = 5, h = 3, w = 2
    return {"video": torch.randn(2, 5, 6, 4, 3, generator=torch.Generator().manual_seed(1))}


def rename_heads(model: nn.Module) -> nn.Module:
    """Every attention's head count moved from ``heads`` to ``num_heads`` (the forward reads
    ``head_dim`` only, so it still runs on one process)."""
    for module in model.modules():
        if isinstance(module, AxialAttention):
            module.num_heads = module.heads
            del module.heads
    return model


def make_num_heads_model() -> nn.Module:
    return rename_heads(Axial3D(FOUR_HEADS))


@pytest.mark.timeout(150)
def test_a_strategy_the_model_cannot_run_is_not_runnable_not_a_failure() -> None:
    strategies = ("dsp", "ulysses", "ring", "megatron_sp")
    report = check_model(
        make_two_head_model, make_inputs, strategies=strategies, sp_sizes=(2, 3), timeout=130
    )  # raises on any FAIL
    ulysses_why = get_method("ulysses").unsupported(3, 2)
    megatron_why = get_method("megatron_sp").unsupported(3, 2)
    assert ulysses_why and megatron_why
    assert report.not_runnable == {
        (3, "ulysses"): ulysses_why,
        (3, "megatron_sp"): f"{megatron_why} (blocks.0.time.qkv)",
    }
    ran = {(c.sp, c.strategy) for c in report.checks}
    assert ran == {(2, s) for s in strategies} | {(3, "dsp"), (3, "ring")}
    assert not report.failures
    rows = {tuple(line.split()[:2]): line for line in report.table().splitlines()[1:]}
    assert rows[("3", "ulysses")].endswith(f"not runnable: {ulysses_why}")
    assert rows[("3", "megatron_sp")].endswith(f"not runnable: {megatron_why} (blocks.0.time.qkv)")
    assert rows[("3", "ring")].endswith("ok") and rows[("2", "ulysses")].endswith("ok")


@pytest.mark.timeout(120)
def test_a_head_count_not_called_heads_fails_with_the_contract_not_an_einops_error() -> None:
    report = check_model(
        make_num_heads_model,
        make_inputs,
        strategies=("megatron_sp",),
        sp_sizes=(3,),
        raise_on_failure=False,
        timeout=100,
    )
    assert report.not_runnable == {}
    assert len(report.failures) == 3  # every rank, the same line
    for line in report.failures:
        assert line.startswith("SP 3, megatron_sp, rank ")
        assert "raised TPContractError: megatron_sp: blocks.0.time (AxialAttention)" in line
        assert "num_heads=4 but no attribute 'heads'" in line and "self.heads = num_heads" in line
        assert "Einops" not in line
    assert "FAIL" in report.table()


def test_not_runnable_reasons_come_from_the_registry_and_the_tp_plan() -> None:
    model = Axial3D(TWO_HEADS)
    assert model_heads(model) == 2
    assert not_runnable("dsp", model, 8) is None  # a policy: it plans around what cannot run
    assert not_runnable("ring", model, 8) is None
    assert not_runnable("ulysses", model, 2) is None
    assert not_runnable("ulysses", model, 3) == get_method("ulysses").unsupported(3, 2)
    assert not_runnable("ulysses", model, 3, heads=4) is None  # heads from a workload win
    assert not_runnable("megatron_sp", model, 2) is None

    plain = nn.Sequential(nn.Linear(4, 4))
    why = not_runnable("megatron_sp", plain, 2)
    assert why == "Sequential declares no TP_PLAN linears (tensor parallelism has nothing to shard)"

    narrow = Mlp(4, 0.5)  # 2 hidden units, sharded by feature
    assert tp_units(narrow).unit == "features" and tp_units(narrow).units == 2
    why = not_runnable("megatron_sp", narrow, 3)
    assert why == "megatron_sp shards features: Mlp.fc1 has 2 per group < 3 ranks"
    # a broken contract is not a reason to skip: running it reports the contract error
    assert not_runnable("megatron_sp", rename_heads(Axial3D(TWO_HEADS)), 3) is None


class BadPlan(nn.Module):
    TP_PLAN = {"qkv": ("column", 3), "proj": "row"}

    def __init__(self, heads: object = 4, qkv_out: int = 48) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(16, qkv_out), nn.Linear(16, 16)


def test_the_tensor_parallel_contract_is_checked_with_clear_messages() -> None:
    check_tp_contract(BadPlan())  # 4 heads of 4 features in each of q, k, v: fine
    assert tp_units(BadPlan()).units == 4
    with pytest.raises(TPContractError, match=r"declares no TP_PLAN"):
        check_tp_contract(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TPContractError, match=r"num_heads=4 but no attribute 'heads'"):
        check_tp_contract(make_num_heads_model())
    with pytest.raises(TPContractError, match=r"\.heads is '4'; .* an int >= 1"):
        check_tp_contract(BadPlan(heads="4"))
    with pytest.raises(TPContractError, match=r"qkv has 45 outputs, which do not split into 3"):
        check_tp_contract(BadPlan(qkv_out=45))
    with pytest.raises(TPContractError, match=r"qkv has 48 outputs, .* 3 group\(s\) of 5 heads"):
        check_tp_contract(BadPlan(heads=5))

    class Missing(nn.Module):
        TP_PLAN = {"fc": "column"}

    with pytest.raises(TPContractError, match=r"Missing.fc is declared in TP_PLAN but is missing"):
        check_tp_contract(Missing())

    class Wrong(nn.Module):
        TP_PLAN = {"fc": ("row", 2)}

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

    with pytest.raises(TPContractError, match=r"bad TP_PLAN entry \('row', 2\)"):
        check_tp_contract(Wrong())
    assert issubclass(TPContractError, ValueError)  # one line at an entry point

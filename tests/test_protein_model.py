"""Evoformer under DSP: every layer and the whole trunk (with recycling and dropout) equal one
process at SP 2, 3, 4 on R = 13 residues and S = 7 MSA rows; chunked == unchunked; plan bytes
== traced bytes per block; bad inputs fail on every rank; the OpenFold converter round trip."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint

import dspzoo.domains.protein  # noqa: F401  (registers the family)
from dspzoo.core.parallel.context import recompute_contexts
from dspzoo.core.parallel.mesh import build_mesh
from dspzoo.core.parallel.multiplan import ActShape, Gather, MultiStage, plan_multi
from dspzoo.core.parallel.rng import mix_key
from dspzoo.core.parallel.runtime import SeqParallel
from dspzoo.core.parallel.trace import trace_comm
from dspzoo.core.parallel.validate import InputValidationError
from dspzoo.core.testing import run_distributed
from dspzoo.core.train.fsdp import shard_units, sublayer_units
from dspzoo.domains.protein import CONFIGS, Evoformer, evoformer_plan
from dspzoo.domains.protein.convert_openfold import (
    from_openfold,
    load_openfold,
    openfold_to_ours_key,
    to_openfold,
)
from dspzoo.domains.protein.model import OUTPUTS
from dspzoo.zoo import count_parameters, create_model

R, S, B = 13, 7, 2
KEY = mix_key(0, 5)


def make_batch(b: int = B, s: int = S, r: int = R, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random features in the contract's layout, with padding and masked MSA entries."""
    g = torch.Generator().manual_seed(seed)
    aatype = torch.randint(0, 21, (b, r), generator=g)
    target_feat = torch.zeros(b, r, 22)
    target_feat.scatter_(2, (aatype + 1)[..., None], 1.0)
    seq_mask = torch.ones(b, r)
    seq_mask[0, -3:] = 0.0  # padding in the first sample
    msa_mask = (torch.rand(b, s, r, generator=g) > 0.15).float() * seq_mask[:, None]
    residue_index = torch.arange(r).repeat(b, 1) + torch.tensor([[0], [40]])[:b]
    residue_index[:, r // 2 :] += 50  # a chain break: relative positions saturate
    return {
        "aatype": aatype,
        "target_feat": target_feat,
        "msa_feat": torch.randn(b, s, r, 49, generator=g),
        "residue_index": residue_index,
        "seq_mask": seq_mask,
        "msa_mask": msa_mask,
    }


def make_model(seed: int = 0, **changes) -> Evoformer:
    torch.manual_seed(seed)
    model = Evoformer(replace(CONFIGS["tiny"], **changes))
    with torch.no_grad():  # AF2-style zero inits would hide layers; random weights test them
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def loss_of(out: dict[str, torch.Tensor], seq_mask: torch.Tensor) -> torch.Tensor:
    """A loss that weights every real (unpadded) output element differently, like a masked
    distogram loss (padded pairs hold ``bias / eps`` from the outer product mean's empty norm:
    large values that a loss must mask, as AF2's does). Same on every rank."""
    pair = seq_mask[:, :, None, None] * seq_mask[:, None, :, None]
    masks = {"distogram_logits": pair, "pair": pair, "msa_first_row": seq_mask[..., None]}
    total = torch.zeros(())
    for i, k in enumerate(sorted(out)):
        w = torch.randn(out[k].shape, generator=torch.Generator().manual_seed(10 + i))
        total = total + (out[k] * w * masks[k]).sum()
    return total


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# -- one process ------------------------------------------------------------------------------
def test_plan_shards_msa_and_pair_like_dap():
    plan = evoformer_plan(CONFIGS["af2"], residues=R, msa_depth=S, sp_size=4)
    dims = {st.stage.name: dict(st.sharded) for st in plan.steps}
    assert dims["msa_row"]["m"] == "s" and dims["msa_col"]["m"] == "r"
    assert dims["outer_product_mean"]["m"] == "r"
    assert [
        dims[n]["z"] for n in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end")
    ] == [
        "i",
        "j",
        "i",
        "j",
    ]
    assert plan.switches_per_period == 6
    (sw,) = plan.step_for("msa_row").switches
    assert (sw.activation, sw.src, sw.dst, sw.launch_after) == ("m", "r", "s", "outer_product_mean")
    table = plan.describe()
    assert "async, from outer_product_mean" in table and "pair bias[8]" in table
    # one process: nothing to send
    assert evoformer_plan(CONFIGS["af2"], R, S, 1).bytes_per_period() == 0


def test_multiplan_declarations_are_checked():
    shapes = {"m": ActShape(("s", "r"), (S, R), 4), "z": ActShape(("i", "j"), (R, R), 2)}
    ok = (MultiStage("a", {"m": "r"}), MultiStage("b", {"m": "s", "z": ()}, aligned=("m", "z")))
    plan = plan_multi(shapes, ok, 2, [("m.r", "z.i", "z.j")])
    assert plan.step_for("b").dim("m") == "r" and plan.switches_per_period == 2
    with pytest.raises(ValueError, match="unknown activation"):
        plan_multi(shapes, (MultiStage("a", {"x": ()}),), 2)
    with pytest.raises(ValueError, match="different lengths"):
        plan_multi(shapes, ok, 2, [("m.s", "z.i")])
    with pytest.raises(ValueError, match="on one axis"):
        plan_multi(shapes, (MultiStage("b", {"m": "r", "z": ()}, aligned=("m", "z")),), 2, [])
    with pytest.raises(ValueError, match="mixes every dim"):
        plan_multi(shapes, (MultiStage("c", {"z": ("i", "j")}),), 2)
    with pytest.raises(ValueError, match="gathers along"):
        MultiStage("d", {"m": ()}, gathers=(Gather("z", 1),))


def test_chunked_equals_unchunked_and_inplace_inference():
    model, batch = make_model().eval(), make_batch()
    ref = model(batch)
    out = model(batch, chunk_size=3)
    with torch.no_grad():
        fast = model(batch, chunk_size=2)  # in place, chunked, no autograd
    for k in ref:
        assert rel(out[k], ref[k]) < 1e-5, k
        assert rel(fast[k], ref[k]) < 1e-5, k
    assert batch["msa_feat"].equal(make_batch()["msa_feat"])  # inputs untouched


def test_bad_inputs_name_the_feature():
    model, batch = make_model().eval(), make_batch()
    cases = {
        "seq_mask": lambda b: b.update(seq_mask=torch.ones(B, R + 1)),
        "target_feat must be": lambda b: b.update(target_feat=torch.zeros(B, R, 21)),
        "msa_feat must be": lambda b: b.update(msa_feat=torch.zeros(B, S, R, 48)),
        "missing feature": lambda b: b.pop("msa_mask"),
        "integer": lambda b: b.update(aatype=b["aatype"].float()),
    }
    for needle, edit in cases.items():
        bad = dict(batch)
        edit(bad)
        with pytest.raises(ValueError, match=needle):
            model(bad)
    model.train()
    with pytest.raises(ValueError, match="rng_key"):
        model(batch)


def test_zoo_configs():
    af2 = create_model("evoformer-af2", device="meta")
    assert af2.config.num_blocks == 48 and (af2.config.c_m, af2.config.c_z) == (256, 128)
    assert (af2.config.msa_heads, af2.config.pair_heads) == (8, 4)
    assert 87_000_000 < count_parameters(af2) < 89_000_000
    assert count_parameters(create_model("evoformer-tiny")) < 100_000


def test_converter_round_trip():
    model = make_model()
    names = to_openfold(model.state_dict())
    for key in (
        "evoformer.blocks.1.msa_att_col._msa_att.mha.linear_q.weight",
        "evoformer.blocks.0.core.tri_mul_in.linear_b_g.bias",
        "evoformer.blocks.0.core.tri_att_end.linear.weight",
        "evoformer.blocks.0.msa_att_row.linear_z.weight",
        "aux_heads.distogram.linear.weight",
        "input_embedder.linear_relpos.weight",
    ):
        assert key in names, key
    back, conv = load_openfold(names, CONFIGS["tiny"])
    assert not conv.zero_filled and not conv.ignored
    assert back.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_converter_openfold3_block_by_hand():
    """An openfold3-named block (no AF3 biases, ``pair_stack.``, ``transition_mlp``)."""
    cfg = CONFIGS["tiny"]
    model = make_model()
    of3 = {}
    for k, v in model.state_dict().items():
        if not k.startswith("evoformer.blocks."):
            continue
        name = (
            k.replace("evoformer.", "")
            .replace("msa_att_col.", "msa_att_col._msa_att.")
            .replace("transition.linear_1", "transition.transition_mlp.layers.0.0")
            .replace("transition.linear_2", "transition.transition_mlp.linear_out")
        )
        for layer in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_trans"):
            name = name.replace(f".{layer}", f".pair_stack.{layer}")
        name = name.replace("tri_att_start.linear.", "tri_att_start.linear_z.")
        name = name.replace("tri_att_end.linear.", "tri_att_end.linear_z.")
        no_bias = ("mha.linear_g.bias", "mha.linear_o.bias", "linear_a_p.bias", "linear_z.bias")
        if name.endswith(no_bias) and "opm" not in name:
            continue
        of3[name] = torch.full_like(v, float(len(of3)))
    of3["linear.weight"] = torch.zeros(12, cfg.c_m)  # the stack's single projection: unused
    fresh = make_model(seed=3)
    conv = from_openfold(of3, fresh, stack_only=True)
    assert conv.ignored == ["linear.weight"]
    assert "evoformer.blocks.0.tri_mul_out.linear_z.bias" in conv.zero_filled
    sd = conv.state_dict
    assert sd["evoformer.blocks.0.tri_mul_out.linear_z.bias"].abs().sum() == 0
    v = of3["blocks.1.pair_stack.tri_att_end.linear_z.weight"]
    assert torch.equal(sd["evoformer.blocks.1.tri_att_end.linear.weight"], v)
    v = of3["blocks.0.msa_transition.transition_mlp.layers.0.0.weight"]
    assert torch.equal(sd["evoformer.blocks.0.msa_transition.linear_1.weight"], v)
    assert openfold_to_ours_key("model.evoformer.blocks.3.core.pair_transition.linear_2.bias") == (
        "evoformer.blocks.3.pair_transition.linear_2.bias"
    )
    fresh.load_state_dict(sd)  # every key present, every shape right
    with pytest.raises(ValueError, match="no place in this model"):
        from_openfold({**of3, "blocks.0.pair_stack.tri_mul_out.linear_ab_p.weight": v}, fresh)
    with pytest.raises(ValueError, match="shape"):
        from_openfold({**of3, "blocks.0.msa_att_row.linear_z.weight": torch.zeros(3, 3)}, fresh)
    with pytest.raises(ValueError, match="no weights for"):
        from_openfold(
            {"blocks.0.msa_att_row.linear_z.weight": of3["blocks.0.msa_att_row.linear_z.weight"]},
            fresh,
        )


# -- SP 2, 3, 4 -------------------------------------------------------------------------------
def _exit_bytes(tracer) -> int:
    """Forward bytes this rank sent gathering the outputs (after the last recycle's blocks)."""
    return sum(r.bytes_sent for r in tracer.filter(phase="forward", region_prefix="recycle1/exit"))


def _sp_worker(rank: int, world: int) -> dict[str, float]:
    mesh = build_mesh(sp_size=world)
    sp = SeqParallel(mesh)
    batch = make_batch()
    report: dict[str, float] = {}

    # 1. whole trunk, recycling, dropout on: outputs and every parameter gradient; traced bytes
    ref_model, model = make_model().train(), make_model().train()
    ref = ref_model(batch, num_recycles=1, rng_key=KEY, outputs=OUTPUTS)
    loss_of(ref, batch["seq_mask"]).backward()
    with trace_comm() as tracer:
        out = model(batch, sp=sp, num_recycles=1, rng_key=KEY, outputs=OUTPUTS)
        loss_of(out, batch["seq_mask"]).backward()
    for k in ref:
        report[f"out {k}"] = rel(out[k], ref[k])
    g_ref, g = grads(ref_model), grads(model)
    assert set(g) == set(g_ref) and len(g) == len(list(model.parameters()))
    flat = torch.cat([t.flatten() for t in g.values()])
    dist.all_reduce(flat, group=sp.group)  # the gradient contract: mean over the SP group
    for (n, t), mean in zip(g.items(), flat.split([t.numel() for t in g.values()])):
        # the pair-bias LayerNorm's bias has an exact gradient of 0 (a softmax ignores a shift
        # that is constant per query row): measure it against its layer's weight gradient
        scale = g_ref.get(n.replace(".bias", ".weight"), g_ref[n]).abs().max()
        report[f"grad {n}"] = float(
            (mean.view_as(t) / world - g_ref[n]).abs().max() / max(scale, 1e-6)
        )
    with torch.no_grad():
        plain = make_model().eval()(batch, num_recycles=1)
    assert rel(plain["pair"], ref["pair"]) > 1e-3  # dropout really acted

    # 1b. every layer of every block recomputed in backward (--fsdp --activation-checkpointing's
    # units), the pair layers' while the MSA's switch back is in flight: what ran without
    checkpointed = make_model().train()
    for unit in sublayer_units(checkpointed):
        checkpoint(unit, context_fn=recompute_contexts)
    with trace_comm() as ck_tracer:
        ck = checkpointed(batch, sp=sp, num_recycles=1, rng_key=KEY, outputs=OUTPUTS)
        loss_of(ck, batch["seq_mask"]).backward()
    for k in ref:
        report[f"checkpointed out {k}"] = rel(ck[k], out[k])
    for n, t in grads(checkpointed).items():
        report[f"checkpointed grad {n}"] = rel(t, g[n])
    recomputed = ck_tracer.total_bytes() - tracer.total_bytes()  # the layers' gathers again
    assert recomputed > 0, recomputed
    # whole blocks cannot be: each begins while the MSA switch of the block before is in
    # flight; the recomputation says so (on every rank alike: nothing is sent before it)
    whole = make_model().train()
    for unit in shard_units(whole):
        checkpoint(unit, context_fn=recompute_contexts)
    out_whole = whole(batch, sp=sp, num_recycles=0, rng_key=KEY, outputs=OUTPUTS)
    with pytest.raises(RuntimeError, match="stage\\('msa_row'\\) needs activation 'm'"):
        loss_of(out_whole, batch["seq_mask"]).backward()

    # 2. chunked, in-place inference at SP N == one process unchunked
    with torch.no_grad():
        fast = make_model().eval()(batch, sp=sp, num_recycles=1, chunk_size=4)
    for k in plain:
        report[f"chunked {k}"] = rel(fast[k], plain[k])
    one_row = make_batch(s=1)  # fewer MSA rows than ranks: some hold none, row 0 on one
    with torch.no_grad():
        alone, sharded = make_model().eval()(one_row), make_model().eval()(one_row, sp=sp)
    for k in alone:
        report[f"one MSA row {k}"] = rel(sharded[k], alone[k])

    # 3. traced bytes per block (the iteration with gradients) == the plan's formula
    plan = model.plan(R, S, world)
    want: dict[tuple[str, str], int] = {}
    for (_, op, phase), nbytes in plan.comm_bytes(rank, batch=B, itemsize=4).items():
        want[(op, phase)] = want.get((op, phase), 0) + nbytes
    for k in range(model.config.num_blocks):
        got: dict[tuple[str, str], int] = {}
        for rec in tracer.filter(region_prefix=f"recycle1/block{k}/"):
            got[(rec.op, rec.phase)] = got.get((rec.op, rec.phase), 0) + rec.bytes_sent
        assert got == want, (k, got, want)
        asyncs = [
            r
            for r in tracer.filter("all_to_all", "forward", f"recycle1/block{k}/")
            if "async" in r.region
        ]
        assert len(asyncs) == 1 and "tri_mul_out" in asyncs[0].region  # overlaps the pair stack
    report["bytes per block"] = float(sum(want.values()))

    # 3b. outside the blocks only the outputs asked for are gathered, each only what it uses:
    # recycling sends nothing; the MSA's row 0 alone, not the whole MSA
    outside = [
        r
        for r in tracer.filter(phase="forward")
        if r.op != "validate"  # the inputs' shape agreement, before anything is sharded
        and not r.region.startswith(("recycle0/block", "recycle1/block", "recycle1/exit"))
    ]
    assert not outside, outside
    r_rows, item, cfg = -(-R // world), 4, model.config
    one_row = (world - 1) * B * R * cfg.c_m * item
    logits = (world - 1) * B * r_rows * R * cfg.distogram_bins * item
    pair = (world - 1) * B * r_rows * R * cfg.c_z * item
    assert _exit_bytes(tracer) == logits + pair + one_row
    with trace_comm() as train_tracer:  # training's default: the distogram logits alone
        assert set(make_model().train()(batch, sp=sp, num_recycles=1, rng_key=KEY)) == {
            "distogram_logits"
        }
    assert _exit_bytes(train_tracer) == logits
    report["exit bytes, training default"] = float(logits)

    # 4. bad inputs fail on every rank with the feature named
    for key, value in (("seq_mask", torch.ones(B, R + 1)), ("target_feat", torch.zeros(B, R, 20))):
        try:
            model(dict(batch, **{key: value}), sp=sp)
        except InputValidationError as exc:
            assert key in str(exc), exc
        else:
            raise AssertionError(f"bad {key} accepted on rank {rank}")
    with pytest.raises(ValueError, match="'dsp' strategy only"):
        model(batch, sp=SeqParallel(mesh, strategy="ulysses"))
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_trunk_equals_one_process(world):
    reports = run_distributed(_sp_worker, world, timeout=240)
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if "bytes" not in k and v > 1e-5}
        assert not bad, (world, rank, bad)
    assert reports[0]["bytes per block"] > 0

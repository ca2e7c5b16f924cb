"""Blocks that receive plain tensors (core/context.py) equal blocks on the explicit API.

* A conv-video model whose block is written with ``stage(...)`` and argument-free
  ``SeqSelfAttention``/``Mlp`` calls, on the weights of ``examples/mixing_ops.ConvVideo``
  (written with ``SeqTensor``/``sp.to_stage``/``(x, spec, sp)``), gives the same outputs and
  gradients at SP 2 and 3 under ``dsp`` and ``ulysses``, both equal to one process, with the
  same traced bytes; under the public harness (every strategy, SP 2/3/4) it is exact.
* Per-frame modulation travels with the activation: STDiT with per-frame timesteps (sliced by
  ``modulate``/``gated``/the final layer for the current layout) is exact at SP 2/3.
* The Evoformer's layers called outside any region are the single-device layers: AF2's
  Algorithm 6 written out by hand with them equals the trunk.
* Misuse gives clear errors: ``stage`` outside a region, a wrong tensor handed to ``stage``,
  an activation replaced while the plan's overlapped switch of it is in flight.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from dspzoo.core import SeqParallel, Stage
from dspzoo.core.harness import check_model
from dspzoo.core.layers.attention import SeqSelfAttention
from dspzoo.core.layers.mlp import Mlp
from dspzoo.core.parallel.context import layout, local, stage
from dspzoo.core.parallel.trace import comm_region, trace_comm
from dspzoo.core.parallel.validate import validate_collectively
from dspzoo.core.testing import run_distributed
from dspzoo.examples.mixing_ops import ConvBlock, ConvVideo, MixerConfig, mixer_workload

CFG = MixerConfig(hidden=16, heads=4, depth=2)
T, S = 5, 7  # no SP size in 2..4 divides either


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] != CFG.in_channels:
        raise ValueError(f"PlainConvVideo wants [B, T, S, {CFG.in_channels}], got {tuple(x.shape)}")


class PlainConvBlock(ConvBlock):
    """``ConvBlock`` (same modules, same parameter names) written on plain tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = stage("spatial", x)
        x = x + self.spatial(self.norm1(x))
        x = stage("conv", x)
        x = x + self.conv(self.norm2(x))
        x = stage("mlp", x)
        return x + self.mlp(self.norm3(x))


class PlainConvVideo(ConvVideo):
    """``ConvVideo`` whose blocks receive plain tensors inside ``sp.region``."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(PlainConvBlock(cfg) for _ in range(cfg.depth))

    def forward(self, x: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        validate_collectively(lambda: _check(x), sp.group, "PlainConvVideo", x.device)
        act = sp.enter(x, ("t", "s"), self.STAGES)
        with sp.region(act) as region:
            h = self.embed(act.tensor)
            for i, block in enumerate(self.blocks):
                with comm_region(f"block{i}"):
                    h = block(h)
            act = region.seq(self.head(h))
        return sp.exit(act)


def make_plain() -> nn.Module:
    return PlainConvVideo(CFG)


def conv_inputs() -> torch.Tensor:
    return torch.randn(2, T, S, 3, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _old_and_new(rank: int, world: int) -> dict[str, float]:
    from dspzoo.core import build_mesh

    mesh = build_mesh(world)
    torch.manual_seed(0)
    old = ConvVideo(CFG)
    new = PlainConvVideo(CFG)
    new.load_state_dict(old.state_dict())  # same parameter names
    x = conv_inputs()
    ref = ConvVideo(CFG)
    ref.load_state_dict(old.state_dict())
    want = ref(x)
    want.square().sum().backward()
    report: dict[str, float] = {}
    for strategy in ("dsp", "ulysses"):
        outs, grads, traced = [], [], []
        for model in (old, new):
            model.zero_grad()
            with trace_comm() as tracer:
                out = model(x, sp=SeqParallel(mesh, strategy))
                out.square().sum().backward()
            outs.append(out)
            grads.append(_grads(model))
            traced.append(tracer.total_bytes())
        assert traced[0] == traced[1] > 0, (strategy, traced)
        assert torch.equal(outs[0], outs[1]), strategy
        for name in grads[0]:
            # the explicit API's gradient contract: mean over the SP group, as DDP would
            g_old, g_new = grads[0][name], grads[1][name]
            torch.testing.assert_close(g_new, g_old, rtol=1e-6, atol=1e-7)
        report[f"{strategy} out"] = float((outs[1] - want).abs().max() / want.abs().max())
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_a_plain_block_equals_the_explicit_one_under_dsp_and_ulysses(world: int) -> None:
    reports = run_distributed(_old_and_new, world, timeout=180)
    for report in reports:
        assert max(report.values()) < 1e-5, report


@pytest.mark.timeout(300)
def test_plain_blocks_are_exact_under_every_strategy_at_sp_2_3_4() -> None:
    wl = mixer_workload("conv_video", CFG, 2, (T, S))
    report = check_model(make_plain, conv_inputs, workload=wl, timeout=280)
    assert all(c.plan_bytes == c.traced_bytes for c in report.checks)
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


# -- a causal SeqSelfAttention stage --------------------------------------------------------------
class PlainCausalVideo(nn.Module):
    """Causal attention along ``t`` (``SeqSelfAttention(causal=True)``), attention along ``s``,
    an MLP: ``[B, T, S, 3]`` → same shape, on plain tensors."""

    STAGES = (
        Stage("time", ("t",), heads=2, causal=True),
        Stage("space", ("s",), heads=2),
        Stage("mlp"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, 8), nn.Linear(8, 3)
        self.time = SeqSelfAttention(8, 2, over="t", causal=True)
        self.space = SeqSelfAttention(8, 2, over="s")
        self.mlp = Mlp(8, ratio=2.0)

    def forward(self, x: torch.Tensor, sp: SeqParallel | None = None) -> torch.Tensor:
        sp = sp or SeqParallel()
        act = sp.enter(x, ("t", "s"), self.STAGES)
        with sp.region(act) as region:
            h = self.embed(act.tensor)
            h = stage("time", h)
            h = h + self.time(h)
            h = stage("space", h)
            h = h + self.space(h)
            h = stage("mlp", h)
            act = region.seq(self.head(h + self.mlp(h)))
        return sp.exit(act)


def make_causal() -> nn.Module:
    return PlainCausalVideo()


def test_a_causal_seq_self_attention_sees_no_later_position() -> None:
    """One process: changing frame 3 leaves every earlier frame's output as it was."""
    torch.manual_seed(0)
    model = make_causal()
    x = conv_inputs()
    y = x.clone()
    y[:, 3] += 1.0
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=0)
    assert not torch.allclose(a[:, 3:], b[:, 3:])


@pytest.mark.timeout(200)
def test_a_causal_seq_self_attention_is_exact_under_the_embedded_methods() -> None:
    """The mask reaches each method: DSP (``t`` whole), and ring, the balanced ring and
    balanced LSS over a sharded ``t`` (T = 5 at SP 2 and 3)."""
    report = check_model(
        make_causal, conv_inputs, strategies=("dsp", "ring", "ring_balanced", "lss_balanced"),
        sp_sizes=(2, 3), timeout=180,
    )  # fmt: skip
    assert len(report.checks) == 4 * (2 + 3) and not report.failures
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


# -- per-frame modulation travels with the activation ---------------------------------------------
def make_stdit() -> nn.Module:
    from dspzoo.zoo import create_model

    model = create_model("stdit-tiny", depth=2)
    with torch.no_grad():  # away from adaLN-Zero's identity, so every branch counts
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model.eval()  # no label dropout: the inputs decide everything


def stdit_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    t = torch.rand(2, 5, generator=g) * 900  # per-frame timesteps: [B, T'] → [B, T', 1, 6, C]
    return torch.randn(2, 12, 5, 6, 6, generator=g), t, torch.tensor([1, 2])


def forward_stdit(model: nn.Module, inputs: tuple, sp: SeqParallel) -> torch.Tensor:
    x, t, y = inputs
    return model(x, t, y=y, sp=sp)


@pytest.mark.timeout(300)
def test_per_frame_modulation_is_sliced_for_the_current_layout() -> None:
    report = check_model(
        make_stdit, stdit_inputs, forward_stdit, strategies=("dsp", "ulysses"), sp_sizes=(2, 3),
        timeout=280,
    )  # fmt: skip
    assert max(c.output_error for c in report.checks) <= 1e-5
    assert max(c.grad_error for c in report.checks) <= 1e-5


# -- the Evoformer's layers outside a region are the single-device layers ---------------------------
def test_evoformer_layers_outside_a_region_are_the_single_device_layers() -> None:
    from dspzoo.domains.protein import CONFIGS
    from dspzoo.domains.protein.model import Evoformer

    cfg = replace(CONFIGS["tiny"], num_blocks=1, msa_dropout=0.0, pair_dropout=0.0)
    torch.manual_seed(0)
    model = Evoformer(cfg).eval()
    g = torch.Generator().manual_seed(4)
    m, z = torch.randn(1, 3, 6, cfg.c_m, generator=g), torch.randn(1, 6, 6, cfg.c_z, generator=g)
    msa_mask = (torch.rand(1, 3, 6, generator=g) > 0.2).float()
    seq_mask = torch.ones(1, 6)
    seq_mask[0, -1] = 0.0
    pair_mask = seq_mask[:, :, None] * seq_mask[:, None, :]
    b = model.evoformer.blocks[0]
    with torch.no_grad():
        want_m, want_z = model.trunk(m, z, msa_mask, seq_mask)
        hm, hz = m.clone(), z.clone()  # Algorithm 6 by hand, no region, no stage
        hm = hm + b.msa_att_row(hm, hz, msa_mask)
        hm = hm + b.msa_att_col(hm, msa_mask)
        hm = hm + b.msa_transition(hm, msa_mask)
        hz = hz + b.outer_product_mean(hm, msa_mask)
        for layer in (b.tri_mul_out, b.tri_mul_in, b.tri_att_start, b.tri_att_end):
            hz = hz + layer(hz, pair_mask)
        hz = hz + b.pair_transition(hz, pair_mask)
    torch.testing.assert_close(hm, want_m)
    torch.testing.assert_close(hz, want_z)


# -- clear errors -------------------------------------------------------------------------------
def test_stage_and_attention_outside_a_region_raise_naming_the_fix() -> None:
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(
        RuntimeError, match=r"stage\('spatial'\) needs an open sharded region.*sp\.region"
    ):
        stage("spatial", x)
    with pytest.raises(RuntimeError, match="SeqSelfAttention.*without \\(spec, sp\\).*sp.region"):
        SeqSelfAttention(8, 2, over="s")(x)
    with pytest.raises(RuntimeError, match="layout"):
        layout()
    assert local(x) is x  # single device: nothing to slice
    assert Mlp(8)(x).shape == x.shape  # token-wise: a plain MLP outside a region


def test_stage_names_a_wrong_tensor_and_a_wrong_call() -> None:
    sp = SeqParallel()
    model = PlainConvVideo(CFG)
    act = sp.enter(torch.randn(2, T, S, CFG.hidden), ("t", "s"), model.STAGES)
    with sp.region(act):
        with pytest.raises(ValueError, match="is not this rank's shard of the activation"):
            stage("spatial", torch.randn(2, T + 1, S, CFG.hidden))
        with pytest.raises(TypeError, match="carries one activation"):
            stage("spatial", x=act.tensor)
        with pytest.raises(ValueError, match="not in the plan"):
            stage("nope", act.tensor)


def _replaced_in_flight(rank: int, world: int) -> str:
    from dspzoo.core import build_mesh
    from dspzoo.core.parallel.multiplan import MultiParallel
    from dspzoo.domains.protein import CONFIGS
    from dspzoo.domains.protein.model import evoformer_plan

    cfg = CONFIGS["tiny"]
    sp = SeqParallel(build_mesh(world))
    plan = evoformer_plan(cfg, 5, 3, world)
    mp = MultiParallel(sp, plan)
    local = {}
    for name, channels in (("m", cfg.c_m), ("z", cfg.c_z)):
        spec = mp.spec(name, plan.entry(name))
        local[name] = torch.zeros(1, *spec.local_shape(rank, world), channels)
    m, z = local["m"], local["z"]
    try:
        with mp.region(m=m, z=z):
            m, z = stage("msa_row", m=m, z=z)
            m = stage("msa_col", m=m)
            m = stage("msa_transition", m=m)
            m, z = stage("outer_product_mean", m=m, z=z)
            z = stage("tri_mul_out", z=z)  # the plan launches m's switch back to s here
            m = m + 1  # ...and the block changes m while it is in flight
            stage("msa_row", m=m, z=z)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_replacing_an_activation_in_flight_raises_on_every_rank() -> None:
    messages = run_distributed(_replaced_in_flight, 2, timeout=100)
    assert len(set(messages)) == 1, messages
    assert "activation 'm' was replaced after the plan launched its switch" in messages[0]

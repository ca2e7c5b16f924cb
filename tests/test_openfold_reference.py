"""OpenFold3's AF2 Evoformer as the reference for this model (skipped without ``openfold3``).

Builds ``openfold3.core.model.latent.evoformer.EvoformerStack`` with random weights (its output
projections start at zero, so every parameter is re-drawn), converts its state dict with
:mod:`dspzoo.domains.protein.convert_openfold` and compares every layer and the whole stack.

One difference is by design: openfold3's pair block calls the ending-node triangle attention
with ``transpose_bias=True``, which biases query ``i``, key ``k`` (column ``j``) with
``z_ik``; AF2 (Algorithm 14, DeepMind's ``per_column`` orientation) and OpenFold 1 use
``z_ki``, as this model does. The test shows the layer equals openfold3's with
``transpose_bias=False`` and differs with its default, and compares the whole stack with that
one call switched to AF2's orientation.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import replace

import pytest
import torch

evoformer = pytest.importorskip("openfold3.core.model.latent.evoformer")

from dspzoo.domains.protein import CONFIGS  # noqa: E402
from dspzoo.domains.protein.convert_openfold import load_openfold  # noqa: E402

B, S, R = 1, 5, 11


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = evoformer.EvoformerStack(
            c_m=16, c_z=8, c_hidden_msa_att=4, c_hidden_opm=4, c_hidden_mul=8,
            c_hidden_pair_att=4, c_s=12, no_heads_msa=2, no_heads_pair=2, no_blocks=2,
            transition_type="relu", transition_n=2, msa_dropout=0.15, pair_dropout=0.25,
            no_column_attention=False, opm_first=False, fuse_projection_weights=False,
            blocks_per_ckpt=None, inf=1e9, eps=1e-8,
        ).eval()  # fmt: skip
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    return ref


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    m = torch.randn(B, S, R, 16, generator=g)
    z = torch.randn(B, R, R, 8, generator=g)
    msa_mask = (torch.rand(B, S, R, generator=g) > 0.2).float()
    seq_mask = torch.ones(B, R)
    seq_mask[:, -2:] = 0.0
    return m, z, msa_mask, seq_mask


def _af2_end_node(ref: torch.nn.Module) -> None:
    """Call every block's ending-node attention with AF2's bias orientation."""
    for block in ref.blocks:
        att = block.pair_stack.tri_att_end
        original = att.forward

        def forward(self, *args, _original=original, **kwargs):
            kwargs["transpose_bias"] = False
            return _original(*args, **kwargs)

        att.forward = types.MethodType(forward, att)


def test_layers_and_stack_match_openfold3():
    ref = _reference()
    ours, conv = load_openfold(ref.state_dict(), replace(CONFIGS["tiny"], msa_dropout=0.0))
    ours.eval()
    assert conv.ignored == ["linear.weight", "linear.bias"]  # the single projection (c_s)
    assert conv.zero_filled  # AF3-style defaults: gates and outputs without bias
    m, z, msa_mask, seq_mask = _inputs()
    pair_mask = seq_mask[:, :, None] * seq_mask[:, None, :]
    # single device: the layers called outside a region (whole masks, no gathers)
    theirs, mine = ref.blocks[0], ours.evoformer.blocks[0]
    ps = theirs.pair_stack
    zt, pmt = z.transpose(-2, -3), pair_mask.transpose(-1, -2)
    with torch.no_grad():
        pairs = {
            "msa_att_row": (
                theirs.msa_att_row(m, z=z, mask=msa_mask),
                mine.msa_att_row(m, z, msa_mask),
            ),
            "msa_att_col": (
                theirs.msa_att_col(m, mask=msa_mask),
                mine.msa_att_col(m, msa_mask),
            ),
            "msa_transition": (
                theirs.msa_transition(m, mask=msa_mask),
                mine.msa_transition(m, msa_mask),
            ),
            "outer_product_mean": (
                theirs.outer_product_mean(m, mask=msa_mask),
                mine.outer_product_mean(m, msa_mask),
            ),
            "tri_mul_out": (
                ps.tri_mul_out(z, mask=pair_mask),
                mine.tri_mul_out(z, pair_mask),
            ),
            "tri_mul_in": (
                ps.tri_mul_in(z, mask=pair_mask),
                mine.tri_mul_in(z, pair_mask),
            ),
            "tri_att_start": (
                ps.tri_att_start(z, mask=pair_mask),
                mine.tri_att_start(z, pair_mask),
            ),
            "tri_att_end": (
                ps.tri_att_end(zt, mask=pmt, transpose_bias=False).transpose(-2, -3),
                mine.tri_att_end(z, pair_mask),
            ),
            "pair_transition": (
                ps.pair_transition(z, mask=pair_mask),
                mine.pair_transition(z, pair_mask),
            ),
        }
        for name, (want, got) in pairs.items():
            want = want[0] if isinstance(want, tuple) else want
            err = (got - want).abs().max() / want.abs().max()
            assert err < 1e-5, (name, float(err))
        default = ps.tri_att_end(zt, mask=pmt, transpose_bias=True).transpose(-2, -3)
        assert (default - pairs["tri_att_end"][1]).abs().max() > 1e-3  # openfold3's orientation

        _af2_end_node(ref)
        want_m, want_z, _ = ref(m.clone(), z.clone(), msa_mask=msa_mask, pair_mask=pair_mask)
        got_m, got_z = ours.trunk(m, z, msa_mask, seq_mask)
        got_mc, got_zc = ours.trunk(m, z, msa_mask, seq_mask, chunk_size=3)
    for want, got in ((want_m, got_m), (want_z, got_z), (want_m, got_mc), (want_z, got_zc)):
        assert (got - want).abs().max() / want.abs().max() < 1e-5

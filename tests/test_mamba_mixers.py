"""Mamba1Mixer / Mamba2Mixer: state continuation across segments, bidirectional composition,
clear errors, and (optional, when transformers is installed) equality with transformers'
MambaMixer / Mamba2Mixer after loading their state dicts unchanged."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dspzoo.core.layers.mamba import (
    Mamba1Config,
    Mamba1Mixer,
    Mamba2Config,
    Mamba2Mixer,
    MixerState,
)


def mamba1(bidirectional=False, seed=0):
    torch.manual_seed(seed)
    cfg = Mamba1Config(hidden_size=12, state_size=4, expand=2, conv_kernel=4, time_step_rank=3,
                       use_bias=True, bidirectional=bidirectional)  # fmt: skip
    return Mamba1Mixer(cfg).double()


def mamba2(bidirectional=False, seed=0):
    torch.manual_seed(seed)
    cfg = Mamba2Config(hidden_size=12, num_heads=4, head_dim=6, state_size=5, n_groups=2,
                       chunk_size=5, use_bias=True, bidirectional=bidirectional)  # fmt: skip
    return Mamba2Mixer(cfg).double()


MIXERS = {"mamba1": mamba1, "mamba2": mamba2}


def grads(module, inputs, outputs):
    weights = [torch.randn_like(o) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    params = [p for _, p in module.named_parameters()]
    return torch.autograd.grad(loss, params + inputs), weights


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
@pytest.mark.parametrize("cut", [1, 3, 11])
def test_mixer_continues_from_returned_state(kind, cut):
    """mixer(x) == cat(mixer(x1), mixer(x2, state=mixer(x1).state)), gradients included."""
    mixer = MIXERS[kind]()
    x = torch.randn(2, 17, 12, dtype=torch.float64, requires_grad=True)
    full, full_state = mixer(x, return_state=True)
    y1, s1 = mixer(x[:, :cut], return_state=True)
    y2, s2 = mixer(x[:, cut:], state=s1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full)
    torch.testing.assert_close(s2.ssm, full_state.ssm)
    torch.testing.assert_close(s2.conv, full_state.conv)
    torch.manual_seed(1)
    want, _ = grads(mixer, [x], [full, full_state.ssm])
    torch.manual_seed(1)
    got, _ = grads(mixer, [x], [torch.cat([y1, y2], 1), s2.ssm])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_bidirectional_is_mean_of_forward_and_reversed_scans(kind):
    """The bidirectional mixer equals the mean of two one-way mixers, the second run on the
    time-reversed input with the ``_b`` parameters."""
    bi = MIXERS[kind](bidirectional=True)
    fwd, bwd = MIXERS[kind](), MIXERS[kind]()
    params = dict(bi.named_parameters())
    with torch.no_grad():
        for name, p in fwd.named_parameters():
            p.copy_(params[name])
        for name, p in bwd.named_parameters():
            backward_name = {"A_log": "A_b_log"}.get(name, name)
            for stem in ("conv1d", "x_proj", "dt_proj", "D", "dt_bias"):
                if name == stem or name.startswith(stem + "."):
                    backward_name = stem + "_b" + name[len(stem) :]
            p.copy_(params[backward_name])
    x = torch.randn(2, 13, 12, dtype=torch.float64)
    want_mamba1 = (fwd(x) + bwd(x.flip(1)).flip(1)) / 2
    if kind == "mamba1":
        torch.testing.assert_close(bi(x), want_mamba1)
    else:  # Mamba-2 averages before its (nonlinear) gated norm: compare the scan directions
        _, (sf, sb) = bi(x, return_state=True)
        _, rf = fwd(x, return_state=True)
        _, rb = bwd(x.flip(1), return_state=True)
        torch.testing.assert_close(sf.ssm, rf.ssm)
        torch.testing.assert_close(sb.ssm, rb.ssm)
        torch.testing.assert_close(sb.conv, rb.conv)


def test_bidirectional_state_continuation():
    """The reversed scan's state enters from the right: split law in the opposite order."""
    mixer = mamba1(bidirectional=True)
    x = torch.randn(1, 15, 12, dtype=torch.float64)
    full = mixer(x)
    _, (f1, _) = mixer(x[:, :6], return_state=True)
    _, (_, b2) = mixer(x[:, 6:], return_state=True)
    y1 = mixer(x[:, :6], backward_state=b2)
    y2 = mixer(x[:, 6:], state=f1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full)


def test_mixer_errors_name_the_problem():
    mixer = mamba1()
    with pytest.raises(ValueError, match=r"expects \[B, L, C=12\]"):
        mixer(torch.randn(2, 5, 7, dtype=torch.float64))
    bad = MixerState(conv=torch.zeros(2, 24, 3), ssm=torch.zeros(2, 24, 5))
    with pytest.raises(ValueError, match="state must be conv"):
        mixer(torch.randn(2, 5, 12, dtype=torch.float64), state=bad)
    with pytest.raises(ValueError, match="only for bidirectional"):
        mixer(torch.randn(2, 5, 12, dtype=torch.float64), backward_state=bad)
    with pytest.raises(ValueError, match="must equal"):
        Mamba2Config(hidden_size=12, num_heads=5, head_dim=6)


# ----------------------------------------------------------------------------- transformers

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)


def _compare_with_transformers(theirs, ours, hidden):
    missing = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    theirs.eval(), ours.eval()  # their training mode would try the fused CUDA path first
    x = torch.randn(2, 19, hidden, requires_grad=True)
    want, got = theirs(x), ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    w = torch.randn_like(want)
    g_want = torch.autograd.grad((want * w).sum(), [x, *theirs.parameters()])
    g_got = torch.autograd.grad((got * w).sum(), [x, *ours.parameters()])
    names = ["input"] + [n for n, _ in theirs.named_parameters()]
    ours_by_name = dict(zip(["input"] + [n for n, _ in ours.named_parameters()], g_got))
    for name, g in zip(names, g_want):
        torch.testing.assert_close(ours_by_name[name], g, atol=1e-4, rtol=1e-3, msg=name)


@needs_transformers
def test_mamba1_mixer_equals_transformers_mamba_mixer():
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    torch.manual_seed(0)
    cfg = MambaConfig(hidden_size=16, state_size=4, expand=2, conv_kernel=4, time_step_rank=3,
                      num_hidden_layers=1, use_bias=True, use_mambapy=False)  # fmt: skip
    theirs = MambaMixer(cfg, layer_idx=0)
    with torch.no_grad():  # move every parameter away from its init so each one matters
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = Mamba1Mixer(Mamba1Config(hidden_size=16, state_size=4, expand=2, conv_kernel=4,
                                    time_step_rank=3, use_bias=True))  # fmt: skip
    _compare_with_transformers(theirs, ours, 16)


@needs_transformers
def test_mamba2_mixer_equals_transformers_mamba2_mixer():
    from transformers import Mamba2Config as HFMamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    torch.manual_seed(0)
    cfg = HFMamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=5, n_groups=2,
                         expand=2, chunk_size=8, num_hidden_layers=1, use_bias=True)  # fmt: skip
    theirs = HFMamba2Mixer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = Mamba2Mixer(Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, state_size=5,
                                    n_groups=2, chunk_size=8, use_bias=True,
                                    layer_norm_epsilon=cfg.layer_norm_epsilon,
                                    time_step_limit=tuple(cfg.time_step_limit)))  # fmt: skip
    _compare_with_transformers(theirs, ours, 16)

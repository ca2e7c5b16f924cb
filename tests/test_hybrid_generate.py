"""Generation from the hybrid Mamba/attention LM (``hybridlm``): prefill, then one step per token
with a recurrent state in the Mamba layers and a KV cache in the attention layers
(:mod:`dspzoo.domains.mamba.generate`), checked against the full forward in float64.

The command line (``dspzoo generate`` on a ``hybridlm`` folder) is in ``tests/test_inference.py``
with the other Mamba LMs'.
"""

from __future__ import annotations

import pytest
import torch

from dspzoo.domains.mamba.generate import (
    decode_step,
    generate_bytes,
    prefill,
    teacher_forced_logits,
)
from dspzoo.domains.mamba.hybrid import HybridLM
from dspzoo.zoo import create_model

ROPE = pytest.mark.parametrize("rope", [False, True], ids=["no-positions", "rope"])


def _model(rope: bool, **overrides) -> HybridLM:
    """``hybridlm-tiny`` (Mamba-2, attention at layers 1 and 3, 4 query / 2 K/V heads) in fp64;
    the same weights with and without rotary positions (they add no parameters). Queries and
    keys are scaled up so the attention is sharp (at init it is nearly a uniform average)."""
    torch.manual_seed(3)
    model = create_model("hybridlm-tiny", rope=rope, **overrides).double().eval()
    with torch.no_grad():
        for i in model.config.attention_layers:
            model.backbone.layers[i].attn.q.weight.mul_(30)
            model.backbone.layers[i].attn.kv.linear.weight.mul_(30)
    return model


@ROPE
def test_prefill_and_steps_give_the_forward_logits(rope: bool) -> None:
    """Prefill 7 tokens of a batch of 2, then 6 steps: the logits of the forward at all 13
    positions; the attention layers' caches hold every token's K/V."""
    model = _model(rope)
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
    got, states = teacher_forced_logits(model, tokens, 7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    for i in model.config.attention_layers:  # [B, T, H_kv, D]
        assert states[i]["k"].shape == states[i]["v"].shape == (2, 13, 2, 8)
    if rope:  # positions matter here: the same weights without them give other logits
        with torch.no_grad():
            assert (_model(rope=False)(tokens) - want).abs().max() > 1e-2


@ROPE
def test_greedy_generation_is_the_argmax_of_the_growing_forward(rope: bool) -> None:
    """10 greedy tokens after a 5-token prompt: each step's cached logits are the full forward's
    last-position logits over the text so far, and generate_bytes picks their argmax."""
    model = _model(rope)
    prompt = b"def f"
    text = torch.tensor([list(prompt)])
    logits, states = prefill(model, text)
    logits = logits[:, -1]
    for _ in range(10):
        with torch.no_grad():
            want = model(text)[:, -1]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-9)
        token = want.argmax(-1)
        text = torch.cat([text, token[:, None]], 1)
        logits, states = decode_step(model, token, states)
    assert generate_bytes(model, prompt, 10, temperature=0) == bytes(text[0, 5:].tolist())


def test_sampling_with_a_seed_is_reproducible() -> None:
    """The draws come from the generator only: the same seed gives the same bytes, another
    seed other bytes, and the global RNG is not touched."""
    model = _model(rope=True)

    def sample(seed: int) -> bytes:
        gen = torch.Generator().manual_seed(seed)
        return generate_bytes(model, "ab", 24, temperature=1.0, top_k=None, generator=gen)

    before = torch.get_rng_state()
    first = sample(7)
    assert len(first) == 24 and sample(7) == first
    assert sample(8) != first
    assert torch.equal(torch.get_rng_state(), before)
    gen = torch.Generator().manual_seed(7)
    top = generate_bytes(model, "ab", 24, temperature=0.8, top_k=5, generator=gen)
    assert top == generate_bytes(model, "ab", 24, 0.8, 5, torch.Generator().manual_seed(7))


def test_a_step_leaves_the_states_it_was_given() -> None:
    """Two continuations of one prefilled text (a branch): the second step from the same states
    gives what a fresh prefill of that text gives; the caches it was given keep their length."""
    model = _model(rope=True)
    prompt = torch.tensor([[5, 6, 7]])
    _, states = prefill(model, prompt)
    decode_step(model, torch.tensor([8]), states)
    assert states[1]["k"].shape[1] == 3
    branch, _ = decode_step(model, torch.tensor([9]), states)
    want, _ = prefill(model, torch.tensor([[5, 6, 7, 9]]))
    torch.testing.assert_close(branch, want[:, -1], rtol=0, atol=1e-9)


def test_bad_inputs_are_refused_by_name() -> None:
    model = _model(rope=True)
    _, states = prefill(model, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="a prompt of at least one byte"):
        generate_bytes(model, "", 3)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\), got \[0, 300\]"):
        prefill(model, torch.tensor([[0, 300]]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\), got \[-1, -1\]"):
        decode_step(model, torch.tensor([-1]), states)
    with pytest.raises(TypeError, match="integer tensor of token ids"):
        prefill(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length >= 1\], got \(1, 0\)"):
        prefill(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="3 layer states for a model of 4 layers"):
        decode_step(model, torch.tensor([1]), states[:3])
    swapped = [states[1], states[0], *states[2:]]
    with pytest.raises(ValueError, match="layer 0 is a Mamba layer and carries a MixerState"):
        decode_step(model, torch.tensor([1]), swapped)
    no_cache = [states[0], states[0], *states[2:]]
    with pytest.raises(ValueError, match=r"layer 1 is an attention layer .* got MixerState"):
        decode_step(model, torch.tensor([1]), no_cache)
    with pytest.raises(ValueError, match="needs vocab_size >= 256; this model has 100"):
        generate_bytes(_model(rope=False, vocab_size=100), "a", 2)
    with pytest.raises(ValueError, match="need max_new >= 0 and temperature >= 0"):
        generate_bytes(model, "a", -1)

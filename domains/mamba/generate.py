"""Autoregressive decoding of a Mamba LM with a recurrent state per layer.

A Mamba LM needs no KV cache: each layer's mixer carries a fixed-size :class:`MixerState` (the
conv's last ``K-1`` inputs and the SSM state). :func:`prefill` runs the prompt through the
chunked kernels once and keeps every layer's final state; :func:`decode_step` then advances one
token per call with the mixers' recurrent ``step`` — constant work per new byte, whatever the
length of the text so far. Both give the logits :meth:`MambaLM.forward` gives at those
positions (``tests/test_inference.py`` checks it).
"""

from __future__ import annotations

import torch

from dspzoo.core.layers.mamba import MixerState
from dspzoo.domains.text.model import sample_next

from .lm import MambaLM, MambaLMBlock

LayerStates = list[MixerState]


def _block(
    layer: MambaLMBlock, x: torch.Tensor, state: MixerState | None, *, step: bool
) -> tuple[torch.Tensor, MixerState]:
    """``residual + mixer(norm(x))`` of one block, with the mixer's state in and out.

    ``x``: ``[B, L, C]`` (prefill) or ``[B, C]`` (``step``)."""
    wide = torch.promote_types(x.dtype, torch.float32)  # as MambaLMBlock.mix: fp64 stays fp64
    residual = x.to(wide) if layer.residual_in_fp32 else x
    normed = layer.norm(x.to(layer.norm.weight.dtype))
    if step:
        y, state = layer.mixer.step(normed, state)
    else:
        y, state = layer.mixer(normed, state=state, return_state=True)
    return residual + y, state


def _logits(model: MambaLM, x: torch.Tensor) -> torch.Tensor:
    x = model.backbone.norm_f(x.to(model.backbone.norm_f.weight.dtype))
    logits = model.lm_head(x.to(model.lm_head.weight.dtype))
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # as MambaLM.forward


@torch.no_grad()
def prefill(model: MambaLM, tokens: torch.Tensor) -> tuple[torch.Tensor, LayerStates]:
    """``tokens`` ``[B, L]`` → logits ``[B, L, vocab]`` and every layer's state after them."""
    model.check_tokens(tokens)
    x = model.backbone.embeddings(tokens.long())
    states: LayerStates = []
    for layer in model.backbone.layers:
        x, state = _block(layer, x, None, step=False)
        states.append(state)
    return _logits(model, x), states


@torch.no_grad()
def decode_step(
    model: MambaLM, token: torch.Tensor, states: LayerStates
) -> tuple[torch.Tensor, LayerStates]:
    """``token`` ``[B]`` after the text ``states`` summarise → logits ``[B, vocab]`` and the
    states after it (constant work: one recurrent step per layer)."""
    model.check_tokens(token.view(-1, 1))
    if len(states) != len(model.backbone.layers):
        raise ValueError(
            f"decode_step: {len(states)} layer states for a model of "
            f"{len(model.backbone.layers)} layers; start from prefill(model, tokens)"
        )
    x = model.backbone.embeddings(token.long().view(-1))
    new_states: LayerStates = []
    for layer, state in zip(model.backbone.layers, states, strict=True):
        x, state = _block(layer, x, state, step=True)
        new_states.append(state)
    return _logits(model, x), new_states


def generate_bytes(
    model: MambaLM,
    prompt: bytes | str,
    max_new: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> bytes:
    """Sample ``max_new`` bytes after ``prompt`` from a byte-level Mamba LM; returns them.

    The same contract as :meth:`dspzoo.domains.text.model.ByteLM.generate`: ``temperature`` 0
    picks the likeliest byte, ``top_k`` keeps the k likeliest, the draws come from
    ``generator`` only. The prompt is prefilled once, then one recurrent step per byte.
    """
    if isinstance(prompt, str):
        prompt = prompt.encode("utf-8")
    if not prompt:
        raise ValueError("generate needs a prompt of at least one byte")
    if max_new < 0 or temperature < 0:
        raise ValueError(f"need max_new >= 0 and temperature >= 0, got {max_new}, {temperature}")
    if model.config.vocab_size < 256:
        raise ValueError(
            f"a byte-level LM needs vocab_size >= 256; this model has {model.config.vocab_size}"
        )
    was_training = model.training
    model.eval()
    device = model.backbone.embeddings.weight.device
    tokens = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    logits, states = prefill(model, tokens)
    logits = logits[:, -1]
    out: list[int] = []
    try:
        for i in range(max_new):
            byte = sample_next(logits.float(), temperature, top_k, generator)
            out.append(int(byte))
            if i + 1 < max_new:
                logits, states = decode_step(model, byte.view(1), states)
    finally:
        model.train(was_training)
    return bytes(out)

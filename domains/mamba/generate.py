"""Autoregressive decoding of a Mamba LM (a recurrent state per layer) and of the hybrid LM (a
KV cache per attention layer besides).

A Mamba layer needs no KV cache: its mixer carries a fixed-size :class:`MixerState` (the conv's
last ``K-1`` inputs and the SSM state). An attention layer of :class:`~.hybrid.HybridLM` keeps
the keys and values of every token so far (:data:`KVCache`); a new token appends its own and
attends over all of them, its rotary positions continuing from the cache's length.
:func:`prefill` runs the prompt through the model once (the chunked scans, causal attention) and
keeps every layer's state; :func:`decode_step` then advances one token per call — one recurrent
step per Mamba layer (constant work), one query over the cache per attention layer. Both give
the logits the model's ``forward`` gives at those positions (``tests/test_inference.py``,
``tests/test_hybrid_generate.py`` check it). What a layer does in either is its entry in
:data:`LAYER_STEPS`, keyed by the layer's class: the one loop of :func:`generate_bytes` serves
every model built of such layers. Decoding runs in one process (no sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dspzoo.core.layers.mamba import MixerState
from dspzoo.domains.text.model import sample_next

from ...core.errors import UsageError
from .hybrid import AttentionLayer, HybridLM
from .lm import MambaLM, MambaLMBlock

#: An attention layer's cache: ``"k"``, ``"v"`` ``[B, T, H_kv, D]``, the T tokens so far (rotated).
KVCache = dict[str, torch.Tensor]
LayerState = MixerState | KVCache
LayerStates = list[LayerState]
DecodingLM = MambaLM | HybridLM
#: ``(model, layer, index, x, state, step)`` → the layer's output and its state after ``x``:
#: ``x`` ``[B, L, C]`` and ``state`` None (prefill), or ``x`` ``[B, C]`` after ``state`` (step).
LayerStep = Callable[
    [DecodingLM, nn.Module, int, torch.Tensor, LayerState | None, bool],
    tuple[torch.Tensor, LayerState],
]


def _restart_hint(index: int, kind: str, want: str, state: object) -> ValueError:
    return ValueError(
        f"decode_step: layer {index} is {kind} and carries a {want}, got "
        f"{type(state).__name__}; start from prefill(model, tokens) of this model"
    )


def _mamba_layer(
    model: DecodingLM,
    layer: MambaLMBlock,
    index: int,
    x: torch.Tensor,
    state: MixerState | None,
    step: bool,
) -> tuple[torch.Tensor, MixerState]:
    """``residual + mixer(norm(x))`` of one Mamba layer, with the mixer's state in and out."""
    if step and not isinstance(state, MixerState):
        raise _restart_hint(index, "a Mamba layer", "MixerState", state)
    wide = torch.promote_types(x.dtype, torch.float32)  # as MambaLMBlock.mix: fp64 stays fp64
    residual = x.to(wide) if layer.residual_in_fp32 else x
    normed = layer.norm(x.to(layer.norm.weight.dtype))
    if step:
        y, state = layer.mixer.step(normed, state)
    else:
        y, state = layer.mixer(normed, state=state, return_state=True)
    return residual + y, state


def _attention_layer(
    model: HybridLM,
    layer: AttentionLayer,
    index: int,
    x: torch.Tensor,
    cache: KVCache | None,
    step: bool,
) -> tuple[torch.Tensor, KVCache]:
    """Attention and MLP of one attention layer over its KV cache (a new dict: ``cache`` stays
    as it was). The new tokens' rotary positions start at the cache's length."""
    if step and not (isinstance(cache, dict) and {"k", "v"} <= cache.keys()):
        raise _restart_hint(index, "an attention layer", "KV cache {'k', 'v'}", cache)
    new = x[:, None] if step else x  # [B, T, C]
    start = cache["k"].shape[1] if step else 0
    rope = model.rotary(new.shape[1], start, new.device)
    cache = dict(cache) if step else {}
    y = layer.decode(new, rope, cache)  # appends the new K/V to cache
    return (y[:, 0] if step else y), cache


#: How each kind of layer prefills and steps, by its class (subclasses inherit the entry).
LAYER_STEPS: dict[type[nn.Module], LayerStep] = {
    MambaLMBlock: _mamba_layer,
    AttentionLayer: _attention_layer,
}


def _layer_step(layer: nn.Module) -> LayerStep:
    for cls in type(layer).__mro__:
        if cls in LAYER_STEPS:
            return LAYER_STEPS[cls]
    raise TypeError(
        f"no decoding step for a {type(layer).__name__} layer: add its class to LAYER_STEPS"
    )


def _logits(model: DecodingLM, x: torch.Tensor) -> torch.Tensor:
    x = model.backbone.norm_f(x.to(model.backbone.norm_f.weight.dtype))
    logits = model.lm_head(x.to(model.lm_head.weight.dtype))
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the forward


@torch.no_grad()
def prefill(model: DecodingLM, tokens: torch.Tensor) -> tuple[torch.Tensor, LayerStates]:
    """``tokens`` ``[B, L]`` → logits ``[B, L, vocab]`` and every layer's state after them."""
    model.check_tokens(tokens)
    x = model.backbone.embeddings(tokens.long())
    states: LayerStates = []
    for i, layer in enumerate(model.backbone.layers):
        x, state = _layer_step(layer)(model, layer, i, x, None, False)
        states.append(state)
    return _logits(model, x), states


@torch.no_grad()
def decode_step(
    model: DecodingLM, token: torch.Tensor, states: LayerStates
) -> tuple[torch.Tensor, LayerStates]:
    """``token`` ``[B]`` after the text ``states`` summarise → logits ``[B, vocab]`` and the
    states after it (``states`` are left as they were: a text can branch)."""
    model.check_tokens(token.view(-1, 1))
    if len(states) != len(model.backbone.layers):
        raise ValueError(
            f"decode_step: {len(states)} layer states for a model of "
            f"{len(model.backbone.layers)} layers; start from prefill(model, tokens)"
        )
    x = model.backbone.embeddings(token.long().view(-1))
    new_states: LayerStates = []
    for i, (layer, state) in enumerate(zip(model.backbone.layers, states, strict=True)):
        x, state = _layer_step(layer)(model, layer, i, x, state, True)
        new_states.append(state)
    return _logits(model, x), new_states


def teacher_forced_logits(
    model: DecodingLM, tokens: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, LayerStates]:
    """Prefill ``tokens[:, :prompt_len]``, then one :func:`decode_step` per later token of
    ``tokens`` ``[B, L]``: the logits ``[B, L, vocab]`` at every position (what the forward
    gives) and the states after the last token."""
    if not 1 <= prompt_len <= tokens.shape[1]:
        raise ValueError(f"prompt_len must be in [1, {tokens.shape[1]}], got {prompt_len}")
    logits, states = prefill(model, tokens[:, :prompt_len])
    steps = [logits]
    for t in range(prompt_len, tokens.shape[1]):
        step_logits, states = decode_step(model, tokens[:, t], states)
        steps.append(step_logits[:, None])
    return torch.cat(steps, 1), states


def generate_bytes(
    model: DecodingLM,
    prompt: bytes | str,
    max_new: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> bytes:
    """Sample ``max_new`` bytes after ``prompt`` from a byte-level Mamba or hybrid LM; returns
    them.

    The same contract as :meth:`dspzoo.domains.text.model.ByteLM.generate`: ``temperature`` 0
    picks the likeliest byte, ``top_k`` keeps the k likeliest, the draws come from
    ``generator`` only. The prompt is prefilled once, then one :func:`decode_step` per byte.
    """
    if isinstance(prompt, str):
        prompt = prompt.encode("utf-8")
    if not prompt:
        raise UsageError("generate needs a prompt of at least one byte")
    if max_new < 0 or temperature < 0:
        raise UsageError(f"need max_new >= 0 and temperature >= 0, got {max_new}, {temperature}")
    if model.config.vocab_size < 256:
        raise UsageError(
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

"""A hybrid Mamba + attention LM: Mamba layers with an attention layer every ``k``-th layer, as
Jamba (``attn_layer_period`` / ``attn_layer_offset``), Zamba and Megatron-LM's hybrid models do.

``HybridLM(HybridLMConfig(...))`` is a stack of ``num_hidden_layers`` layers over one sequence
dim ``l``; layer ``i`` is

* an **attention layer** when ``i % attn_layer_period == attn_layer_offset``: the text domain's
  pre-norm causal self-attention and MLP (:class:`~dspzoo.domains.text.model.Block`, reused as
  it is), two stages: ``attn`` (op ``attention``, mixes ``l``) and ``mlp`` (mixes nothing);
* a **Mamba layer** otherwise: ``residual + mixer(RMSNorm(x))`` (:class:`~.lm.MambaLMBlock`,
  the block of ``MambaForCausalLM`` / ``Mamba2ForCausalLM``), one stage ``scan`` (op ``scan``).

Every stage mixes the only dim, so under sequence parallelism the sequence stays sharded and
each stage runs with a *method*, chosen per stage by the planner from the method registry:
a scan method for ``scan`` (state passing, or the head all-to-all) and an attention method for
``attn`` (Ulysses, Ring; LSS under its strategy). One model, several methods, one plan::

    tokens [B, L] ─enter─> [B, L/N] ─embed─> scan (state_passing) ─> ... ─> attn (ulysses) ─>
    mlp (local) ─> ... ─> logits [B, L/N, vocab]

``scan_method`` / ``attention_method`` force a method for every stage of that kind (``None``:
the planner's choice). ``rope``: rotary positions in the attention layers (Jamba has none: the
Mamba layers carry the order).

Generation (one process): :mod:`.generate` prefills the prompt and steps one token at a time,
the Mamba layers with their recurrent state, the attention layers with a KV cache
(:meth:`HybridLM.rotary` gives both paths their positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspzoo.core import SeqParallel, SeqTensor, comm_region
from dspzoo.core.parallel import context
from dspzoo.core.parallel.context import stage
from dspzoo.core.parallel.methods.registry import get_method
from dspzoo.core.parallel.plan import Stage
from dspzoo.domains.text.model import Block, ByteLM, ByteLMConfig, rotary_table

from .layers import scan_stage
from .lm import MambaLM, MambaLMBlock, MambaLMConfig, RMSNorm

SEQ_DIMS = ("l",)


@dataclass(frozen=True)
class HybridLMConfig(MambaLMConfig):
    """A :class:`~.lm.MambaLMConfig` (the Mamba layers: ``version`` 1 or 2 and its mixer
    fields) plus the attention layers.

    Attributes:
        attn_layer_period: every ``attn_layer_period``-th layer is an attention layer ...
        attn_layer_offset: ... the one at ``i % attn_layer_period == attn_layer_offset``.
        num_attention_heads: query heads of the attention layers.
        num_key_value_heads: K/V heads (grouped-query attention; ``None``: as many as queries).
        mlp_ratio: the attention layers' MLP width over ``hidden_size``.
        rope: rotary positions in the attention layers (``False``: none, as Jamba).
        rope_base: the rotary frequency base.
        scan_method: force the method of every scan stage over the sharded sequence
            (``"state_passing"``, ``"head_a2a"``; ``None``: the planner's choice).
        attention_method: force the method of every attention stage (``"ulysses"``,
            ``"ring"``, ``"lss"``, ``"usp"``; ``None``: the planner's / strategy's choice).
    """

    attn_layer_period: int = 2
    attn_layer_offset: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    mlp_ratio: float = 4.0
    rope: bool = False
    rope_base: float = 10000.0
    scan_method: str | None = None
    attention_method: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_layer_period < 1 or not 0 <= self.attn_layer_offset < self.attn_layer_period:
            raise ValueError(
                f"need attn_layer_period >= 1 and 0 <= attn_layer_offset < attn_layer_period, "
                f"got {self.attn_layer_period} and {self.attn_layer_offset}"
            )
        for field, kind in (("scan_method", "scan"), ("attention_method", "attention")):
            name = getattr(self, field)
            if name is not None and not get_method(name).runs(kind):
                raise ValueError(f"{field}={name!r} is not a method that runs {kind!r} stages")
        self.attention_config()  # heads dividing the width, rotary head dim: checked there

    def is_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` is an attention layer (else a Mamba layer)."""
        return layer % self.attn_layer_period == self.attn_layer_offset

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_attention(i))

    def attention_config(self) -> ByteLMConfig:
        """The text domain's config of the attention layers (``Block``'s shape)."""
        return ByteLMConfig(
            vocab_size=self.vocab_size,
            hidden=self.hidden_size,
            depth=self.num_hidden_layers,
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            mlp_ratio=self.mlp_ratio,
            position="rope",
            rope_base=self.rope_base,
            bias=self.use_bias,
        )


def hybrid_stages(config: HybridLMConfig) -> tuple[Stage, ...]:
    """The stages of a hybrid LM: ``scan`` (op ``scan``, with the scan's head count for the
    head all-to-all), ``attn`` (op ``attention``, with its query heads for Ulysses) and ``mlp``;
    forced methods from the config."""
    scan = replace(
        scan_stage("scan", "axial(l)"), method=config.scan_method, heads=config.scan_heads
    )
    attn = Stage(
        "attn",
        SEQ_DIMS,
        method=config.attention_method,
        heads=config.num_attention_heads,
        causal=True,
    )
    stages = (scan,) if len(config.attention_layers) < config.num_hidden_layers else ()
    return stages + ((attn, Stage("mlp")) if config.attention_layers else ())


class AttentionLayer(Block):
    """The text domain's block (pre-norm causal self-attention, then an MLP: ByteLM's ``attn``
    and ``mlp``), run on the plain local tensors of the hybrid's open sharded region."""

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None, recompute: bool = False
    ) -> torch.Tensor:
        """``x`` local ``[B, L_l, C]`` → same; ``rope``: the whole ``[L, D]`` table or None.
        ``recompute``: activation checkpointing of the attention and of the MLP (the stages'
        moves stay outside the recomputed parts)."""
        region = context.current("the hybrid LM's attention layer")
        sp = region.sp
        run = _checkpointed if recompute else _call
        act = region.wrap(stage("attn", x))
        x = run(self.attn, act, rope, sp).tensor
        x = stage("mlp", x)
        return run(self.mlp, x, context.layout(), sp)


def _call(fn: Callable, *args):
    return fn(*args)


def _checkpointed(fn: Callable, *args):
    return checkpoint(fn, *args, use_reentrant=False)


class HybridBackbone(nn.Module):
    """Embeddings, the Mamba and attention layers, the final RMSNorm."""

    def __init__(self, config: HybridLMConfig) -> None:
        super().__init__()
        attention = config.attention_config()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttentionLayer(attention) if config.is_attention(i) else MambaLMBlock(config)
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class HybridLM(nn.Module):
    """Causal hybrid LM: ``tokens`` ``[B, L]`` → next-token logits ``[B, L, vocab_size]``.

    Parameters: ``backbone.embeddings``, ``backbone.layers.{i}.norm|mixer.*`` (Mamba layers, the
    names of ``MambaForCausalLM``), ``backbone.layers.{i}.attn.*|mlp.*`` (attention layers, the
    names of ByteLM's blocks), ``backbone.norm_f``, ``lm_head`` (tied to the embeddings when
    ``tie_word_embeddings``).
    """

    def __init__(self, config: HybridLMConfig) -> None:
        super().__init__()
        self.config = config
        self.stages = hybrid_stages(config)
        self.backbone = HybridBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        std = 0.02 / math.sqrt(2 * config.num_hidden_layers)  # GPT-2: the residual projections
        nn.init.normal_(self.backbone.embeddings.weight, std=0.02)
        for layer in self.backbone.layers:
            if isinstance(layer, MambaLMBlock):  # as MambaLM (the mixer keeps its dt, A, D)
                nn.init.normal_(layer.mixer.in_proj.weight, std=0.02)
                nn.init.normal_(layer.mixer.out_proj.weight, std=std)
            else:  # as ByteLM
                layer.apply(ByteLM._init_weights)
                nn.init.normal_(layer.attn.proj.weight, std=std)
                nn.init.normal_(layer.mlp.down.weight, std=std)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    check_tokens = MambaLM.check_tokens

    def rotary(
        self, length: int, start: int = 0, device: torch.device | None = None
    ) -> torch.Tensor | None:
        """The attention layers' rotary table ``[length, head_dim]`` for the global positions
        ``start … start+length−1`` (the whole sequence in :meth:`forward`, the new tokens after
        a KV cache of ``start`` in :mod:`.generate`); ``None`` without ``rope``."""
        cfg = self.config
        if not cfg.rope:
            return None
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        return rotary_table(length, head_dim, cfg.rope_base, start).to(device)

    def forward(
        self, tokens: torch.Tensor, sp: SeqParallel | None = None, gather_output: bool = True
    ) -> torch.Tensor | SeqTensor:
        """Logits for replicated ``tokens`` ``[B, L]``: the replicated ``[B, L, vocab]``, or
        (``gather_output=False``) this rank's shard as a :class:`SeqTensor` (for ``lm_loss``).
        Inputs are validated on every rank of the SP group together."""
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"tokens": tokens}, check=lambda: self.check_tokens(tokens), what="HybridLM inputs"
        )
        rope = self.rotary(tokens.shape[1], device=tokens.device)
        recompute = self.config.checkpoint and torch.is_grad_enabled()
        act = sp.enter(tokens.long(), SEQ_DIMS, self.stages)  # [B, L_local] ids of this rank
        with sp.region(act) as region:
            x = self.backbone.embeddings(act.tensor)
            for i, layer in enumerate(self.backbone.layers):
                with comm_region(f"block{i}"):
                    if isinstance(layer, AttentionLayer):
                        x = layer(x, rope, recompute)
                    elif recompute:
                        x = layer.checkpointed(stage("scan", x))
                    else:
                        x = layer(x)
            x = self.backbone.norm_f(x.to(self.backbone.norm_f.weight.dtype))
            logits = self.lm_head(x.to(self.lm_head.weight.dtype))
            act = region.seq(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        return sp.exit(act) if gather_output else act

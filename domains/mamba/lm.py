"""Mamba language models: transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``, exactly.

``MambaLM(MambaLMConfig(version=1, ...))`` has the module tree and parameter names of
``MambaForCausalLM`` (``backbone.embeddings``, ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``, ``lm_head``), ``version=2`` those of
``Mamba2ForCausalLM``, so their state dicts load unchanged (:mod:`.convert` reads their saved
folders). Any vocabulary; byte-level configs (vocab 256) train on the built-in corpus.

Per layer one stage, ``scan``, mixes the sequence dim ``l`` (:func:`~.layers.scan_stage`): under
a strategy that shards ``l`` the stage gets the sequence whole until the scan methods (state
passing, head all-to-all) are wired into :func:`~.layers.run_scan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspzoo.core import SeqParallel, SeqTensor, comm_region
from dspzoo.core.host_reads import values_readable
from dspzoo.core.parallel.context import recompute_contexts, stage
from dspzoo.core.parallel.plan import Stage

from .layers import build_mixer, run_scan, scan_stage

SEQ_DIMS = ("l",)
STAGES = (scan_stage("scan", "axial(l)"),)  # lm_stages(config) adds the scan's head count


@dataclass(frozen=True)
class MambaLMConfig:
    """transformers' ``MambaConfig`` (``version=1``) / ``Mamba2Config`` (``version=2``) fields
    that shape the model; the names are theirs. ``checkpoint``: recompute every block in the
    backward pass (activation checkpointing)."""

    version: int = 1
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = True
    time_step_rank: int | str = "auto"  # Mamba-1
    num_heads: int = 8  # Mamba-2: num_heads · head_dim = expand · hidden_size
    head_dim: int = 16
    n_groups: int = 1
    chunk_size: int = 256
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"version must be 1 (Mamba) or 2 (Mamba-2), got {self.version}")
        if self.version == 2 and self.num_heads * self.head_dim != self.expand * self.hidden_size:
            raise ValueError(
                f"Mamba-2: num_heads × head_dim ({self.num_heads} × {self.head_dim}) must equal "
                f"expand × hidden_size ({self.expand} × {self.hidden_size})"
            )

    @property
    def scan_heads(self) -> int:
        """What the head all-to-all shards in a scan: Mamba-2's heads, Mamba-1's channels."""
        return self.num_heads if self.version == 2 else self.expand * self.hidden_size

    def mixer_options(self) -> dict:
        """The mixer config fields (:class:`~dspzoo.core.layers.mamba.Mamba1Config` / ``Mamba2Config``)."""
        common = dict(
            state_size=self.state_size,
            expand=self.expand,
            conv_kernel=self.conv_kernel,
            use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias,
            time_step_min=self.time_step_min,
            time_step_max=self.time_step_max,
            time_step_floor=self.time_step_floor,
        )
        if self.version == 1:
            return dict(common, time_step_rank=self.time_step_rank)
        return dict(
            common,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            chunk_size=self.chunk_size,
            layer_norm_epsilon=self.layer_norm_epsilon,
            time_step_limit=tuple(self.time_step_limit),
        )


def lm_stages(config: MambaLMConfig) -> tuple[Stage, ...]:
    """The stages of a Mamba LM: one ``scan`` per layer, with what its head all-to-all shards
    (so the planner rules the method out where there are fewer heads than ranks)."""
    return (replace(STAGES[0], heads=config.scan_heads),)


class RMSNorm(nn.Module):
    """transformers' ``MambaRMSNorm``: normalised in fp32, scaled in the input dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` → same shape."""
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))  # fp32 (fp64 stays fp64)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class MambaLMBlock(nn.Module):
    """``residual + mixer(norm(x))`` (transformers' ``MambaBlock`` / ``Mamba2Block``)."""

    def __init__(self, config: MambaLMConfig) -> None:
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = build_mixer(
            f"mamba{config.version}", config.hidden_size, **config.mixer_options()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` local ``[B, L_l, C]`` → ``[B, L, C]`` (``L`` whole after the stage)."""
        return self.mix(stage("scan", x))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's computation on ``x`` already in the stage's layout (what activation
        checkpointing recomputes: the stage's switch stays outside it)."""
        # fp32 residuals (fp64 stays fp64)
        residual = x.to(torch.promote_types(x.dtype, torch.float32)) if self.residual_in_fp32 else x
        return residual + run_scan(
            self.mixer, self.norm(x.to(self.norm.weight.dtype)), SEQ_DIMS, ("l",)
        )

    def checkpointed(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`mix` under activation checkpointing, on ``x`` in the stage's layout; its
        recomputation in backward (the region closed by then) runs in a snapshot of the region
        (:func:`~dspzoo.core.parallel.context.recompute_contexts`): the same scan method on the
        same segment."""
        return checkpoint(self.mix, x, use_reentrant=False, context_fn=recompute_contexts)


class MambaBackbone(nn.Module):
    """transformers' ``MambaModel`` / ``Mamba2Model``: embeddings, layers, final norm."""

    def __init__(self, config: MambaLMConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaLMBlock(config) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class MambaLM(nn.Module):
    """Causal Mamba-1 LM (``MambaForCausalLM``): ``tokens`` ``[B, L]`` → next-token logits
    ``[B, L, vocab_size]``. :class:`Mamba2LM` is the Mamba-2 one."""

    STAGES = STAGES
    VERSION = 1

    def __init__(self, config: MambaLMConfig) -> None:
        super().__init__()
        if config.version != self.VERSION:
            raise ValueError(
                f"{type(self).__name__} is a Mamba-{self.VERSION} LM but the config has "
                f"version={config.version}; build {lm_class(config.version).__name__} "
                f"(family {('mambalm', 'mamba2lm')[config.version - 1]!r}) for it"
            )
        self.config = config
        self.STAGES = lm_stages(config)
        self.backbone = MambaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.backbone.embeddings.weight, std=0.02)
        for layer in self.backbone.layers:  # GPT-2 style: scale the residual projections
            nn.init.normal_(layer.mixer.in_proj.weight, std=0.02)
            nn.init.normal_(
                layer.mixer.out_proj.weight, std=0.02 / math.sqrt(2 * config.num_hidden_layers)
            )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Raise ``TypeError``/``ValueError`` for token ids the model cannot take."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a tensor, got {type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor of token ids, got {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [batch, length >= 1], got {tuple(tokens.shape)}")
        # the ids' range is read on the host only for CPU tokens (no device sync)
        readable = tokens.numel() > 0 and values_readable(tokens)
        if readable and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )

    def forward(
        self, tokens: torch.Tensor, sp: SeqParallel | None = None, gather_output: bool = True
    ) -> torch.Tensor | SeqTensor:
        """Logits for replicated ``tokens`` ``[B, L]``: the replicated ``[B, L, vocab]``, or
        (``gather_output=False``) this rank's shard as a :class:`SeqTensor` (for ``lm_loss``).
        Inputs are validated on every rank of the SP group together."""
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"tokens": tokens}, check=lambda: self.check_tokens(tokens), what="MambaLM inputs"
        )
        act = sp.enter(tokens.long(), SEQ_DIMS, self.STAGES)  # [B, L_local] ids of this rank
        with sp.region(act) as region:
            x = self.backbone.embeddings(act.tensor)
            for i, layer in enumerate(self.backbone.layers):
                with comm_region(f"block{i}"):
                    if self.config.checkpoint and torch.is_grad_enabled():
                        x = layer.checkpointed(stage("scan", x))
                    else:
                        x = layer(x)
            x = self.backbone.norm_f(x.to(self.backbone.norm_f.weight.dtype))
            logits = self.lm_head(x.to(self.lm_head.weight.dtype))
            act = region.seq(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        return sp.exit(act) if gather_output else act


class Mamba2LM(MambaLM):
    """Causal Mamba-2 LM (``Mamba2ForCausalLM``); see :class:`MambaLM`."""

    VERSION = 2


def lm_class(version: int) -> type[MambaLM]:
    """:class:`MambaLM` for ``version`` 1, :class:`Mamba2LM` for 2."""
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {version}")
    return MambaLM if version == 1 else Mamba2LM

"""ByteLM: a byte-level causal transformer language model over one ultra-long sequence dim.

The activation is ``[B, L, C]`` with a single sequence dim ``"l"``. Each block is pre-norm
causal self-attention (a stage that mixes ``l``) followed by an MLP (a stage that mixes
nothing)::

    tokens [B, L] ──enter──> [B, L/N] ──embed──> [B, L/N, C] ──blocks──> logits [B, L/N, 256]

The model is written as if on one device: ``sp.enter`` splits the bytes over the SP group, the
strategy decides what attention over the sharded ``l`` communicates (Ulysses all-to-alls, ring
K/V passes, LSS's K/V gather, ...), and the loss is taken on every rank's own token shard
(:func:`lm_loss`). Positions are *global*: rotary tables (or learned position rows) are built
for the whole sequence and sliced to this rank's shard with ``sp.shard_like``, whatever
sharding the strategy uses. Under tensor parallelism (``megatron_sp``) the attention and MLP
declare their linears in ``TP_PLAN`` and run on the gathered sequence between
``sp.tp_enter``/``sp.tp_exit``; there the rotary table covers the whole sequence (the spec
``tp_enter`` returns is replicated, so ``shard_like`` leaves the table whole).

Generation (:meth:`ByteLM.generate`) runs in one process with a KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspzoo.core import SeqParallel, SeqSpec, SeqTensor, Stage, comm_region, sp_mean
from dspzoo.core.host_reads import values_readable
from dspzoo.core.layers.attention import attend

SEQ_DIMS = ("l",)
STAGES = (Stage("attn", ("l",), causal=True), Stage("mlp"))  # ByteLM.stages adds the head count
POSITIONS = ("rope", "learned")


@dataclass(frozen=True)
class ByteLMConfig:
    """Shape of a :class:`ByteLM`.

    Attributes:
        vocab_size: 256 for raw bytes.
        hidden: model width C.
        depth: number of blocks.
        heads: query heads (``hidden`` must be divisible by it).
        kv_heads: key/value heads for grouped-query attention (``None``: ``heads``).
        mlp_ratio: MLP width as a multiple of ``hidden``.
        position: ``"rope"`` (rotary, no length limit) or ``"learned"`` (absolute, up to
            ``max_len``).
        max_len: rows of the learned position table (ignored by rotary positions).
        rope_base: rotary frequency base.
        tie_embeddings: the output head shares the byte embedding's weights.
        bias: biases in the linear layers.
        checkpoint: recompute each block in the backward pass instead of saving its
            activations (activation checkpointing).
    """

    vocab_size: int = 256
    hidden: int = 64
    depth: int = 2
    heads: int = 4
    kv_heads: int | None = None
    mlp_ratio: float = 4.0
    position: str = "rope"
    max_len: int = 1024
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = False
    checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by {self.heads} heads")
        if self.heads % self.num_kv_heads:
            raise ValueError(
                f"{self.heads} query heads are not divisible by kv_heads={self.kv_heads}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads


# -- rotary position embeddings --------------------------------------------------------------


def rotary_table(length: int, head_dim: int, base: float = 10000.0, start: int = 0) -> torch.Tensor:
    """``[length, head_dim]`` float32 table ``cos | sin`` for positions ``start … start+length−1``.

    Angles are computed in float64, so positions in the millions keep their precision.
    """
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    positions = torch.arange(start, start + length, dtype=torch.float64)
    angles = positions[:, None] * inv_freq[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, L, H, D]`` by the per-position angles of ``table`` ``[L, D]``."""
    cos, sin = table.to(x.dtype)[:, None, :].chunk(2, dim=-1)  # [L, 1, D/2] each
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# -- the transformer -------------------------------------------------------------------------


class KeyValue(nn.Module):
    """The stacked key and value projections of :class:`CausalSelfAttention`: ``[..., C]`` →
    ``k, v [..., H_kv, D]``.

    A module of its own because it has its own head count ``heads`` (``H_kv``): tensor
    parallelism (``TP_PLAN``, ``megatron_sp``) shards it by K/V heads, the query projection by
    query heads. The local head count is read from the weight.
    """

    TP_PLAN = {"linear": ("column", 2)}

    def __init__(self, hidden: int, heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.linear = nn.Linear(hidden, 2 * heads * head_dim, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.linear(x).unflatten(-1, (2, -1, self.head_dim)).unbind(-3)
        return k, v


class CausalSelfAttention(nn.Module):
    """Pre-norm causal self-attention over ``l`` with optional grouped-query K/V heads.

    Tensor parallelism (``TP_PLAN``, ``megatron_sp``): ``q`` is column-parallel by query heads,
    ``kv`` (:class:`KeyValue`) by its own K/V heads and ``proj`` row-parallel, between the
    ``sp.tp_enter``/``sp.tp_exit`` hooks (which do nothing under other strategies); local head
    counts are read from the weights. Rank ``r`` of ``N`` holds query heads
    ``shard_sizes(H, N)[r]`` and K/V heads ``shard_sizes(H_kv, N)[r]``, so

    * ``N ≤ H_kv`` (every rank needs a K/V head; ``parallelize_megatron`` says so), and
    * with grouped-query attention (``H_kv < H``) every rank must hold whole groups — the
      query heads that read its K/V heads — which holds exactly when ``N`` divides ``H_kv``
      (plain multi-head attention: any ``N ≤ H``). Otherwise the forward raises on every rank.
    """

    TP_PLAN = {"q": "column", "proj": "row"}

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, cfg.head_dim
        self.norm = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.q = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, cfg.bias)
        self.kv = KeyValue(cfg.hidden, self.kv_heads, cfg.head_dim, cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, cfg.bias)

    def project(
        self, h: torch.Tensor, rope: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalised ``h`` ``[B, L, C]`` → ``q [B, L, H, D]`` and ``k, v [B, L, H_kv, D]``
        (local heads when sharded), rotated if ``rope``."""
        q = self.q(h).unflatten(-1, (-1, self.head_dim))
        k, v = self.kv(h)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        return q, k, v

    def check_head_groups(self, local_heads: int, ranks: int) -> None:
        """Raise (on every rank alike) if sharded heads split a grouped-query group."""
        sharded = local_heads < self.heads
        if sharded and self.kv_heads < self.heads and self.kv_heads % ranks:
            raise ValueError(
                f"tensor parallelism over {ranks} ranks shards the {self.heads} query heads and "
                f"the {self.kv_heads} key/value heads separately; with grouped-query attention "
                f"each rank must hold whole groups (the query heads reading its K/V heads), so "
                f"{ranks} must divide kv_heads={self.kv_heads}: use kv_heads a multiple of "
                f"{ranks}, or a sequence-parallel strategy"
            )

    def forward(self, act: SeqTensor, rope: torch.Tensor | None, sp: SeqParallel) -> SeqTensor:
        """``act``: the sharded residual stream; ``rope``: the *full* ``[L, D]`` table or None."""
        x = act.tensor
        # tensor parallelism gathers the sequence here (inner: replicated); else a no-op
        h, inner = sp.tp_enter(self.norm(x), act.spec)
        if rope is not None:  # this rank's rows of the global table, in the current layout
            rope = sp.shard_like(rope, inner, axes={"l": 0})
        q, k, v = self.project(h, rope)
        self.check_head_groups(q.shape[-2], sp.size)
        # K/V keep their H_kv heads: the strategy moves (and LSS gathers) H/H_kv times less
        out = sp.attention(q, k, v, inner, over="l", causal=True)
        return act.with_tensor(x + sp.tp_exit(self.proj, out.flatten(-2), act.spec))

    def decode(
        self, x: torch.Tensor, rope: torch.Tensor | None, cache: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One process, new tokens ``x`` ``[B, T, C]`` after those in ``cache`` (updated)."""
        q, k, v = self.project(self.norm(x), rope)
        if cache:
            if q.shape[1] != 1:
                raise ValueError("decode: after the prompt, feed one token at a time")
            k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
        cache["k"], cache["v"] = k, v
        out = attend(q, k, v, causal=q.shape[1] > 1)  # one new token sees the whole cache
        return x + self.proj(out.flatten(-2))


class MLP(nn.Module):
    """Pre-norm token-wise MLP (mixes no sequence dim).

    Tensor parallelism (``TP_PLAN``): ``up`` column-parallel, ``down`` row-parallel (hidden
    units sharded), between the ``sp.tp_enter``/``sp.tp_exit`` hooks when ``sp`` is given.
    """

    TP_PLAN = {"up": "column", "down": "row"}

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        width = int(cfg.hidden * cfg.mlp_ratio)
        self.norm = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.hidden, width, cfg.bias)
        self.down = nn.Linear(width, cfg.hidden, cfg.bias)

    def forward(
        self, x: torch.Tensor, spec: SeqSpec | None = None, sp: SeqParallel | None = None
    ) -> torch.Tensor:
        """``x`` ``[B, L, C]`` (laid out as ``spec`` under ``sp``; neither: one process)."""
        if sp is None:
            return x + self.down(F.gelu(self.up(self.norm(x))))
        h, _ = sp.tp_enter(self.norm(x), spec)
        return x + sp.tp_exit(self.down, F.gelu(self.up(h)), spec)


class Block(nn.Module):
    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, act: SeqTensor, rope: torch.Tensor | None, sp: SeqParallel) -> SeqTensor:
        act = self.attn(sp.to_stage(act, "attn"), rope, sp)
        act = sp.to_stage(act, "mlp")
        return act.with_tensor(self.mlp(act.tensor, act.spec, sp))

    def decode(
        self, x: torch.Tensor, rope: torch.Tensor | None, cache: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.mlp(self.attn.decode(x, rope, cache))


class ByteLM(nn.Module):
    """Byte-level causal LM: ``tokens [B, L]`` (int64 bytes) → next-byte logits ``[B, L, 256]``."""

    def __init__(self, config: ByteLMConfig) -> None:
        super().__init__()
        self.config = config
        # the head count lets a planner avoid Ulysses when there are fewer heads than ranks
        self.stages = (replace(STAGES[0], heads=config.heads), STAGES[1])
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos = (
            nn.Embedding(config.max_len, config.hidden) if config.position == "learned" else None
        )
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.hidden, bias=config.bias)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.depth))
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # -- inputs ------------------------------------------------------------------------------
    def check_tokens(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Raise ``TypeError``/``ValueError`` for inputs the model cannot take."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a tensor, got {type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor of byte values, got {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [batch, length >= 1], got {tuple(tokens.shape)}")
        # the ids' range is read on the host only for CPU tokens (no device sync)
        readable = tokens.numel() > 0 and values_readable(tokens)
        if readable and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(
                f"token values must lie in [0, {self.config.vocab_size}), got "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        if self.pos is not None and tokens.shape[1] > self.config.max_len:
            raise ValueError(
                f"length {tokens.shape[1]} exceeds the learned position table "
                f"(max_len={self.config.max_len}); use rotary positions or a larger max_len"
            )
        if targets is not None and (
            not isinstance(targets, torch.Tensor) or targets.shape != tokens.shape
        ):
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
            raise ValueError(
                f"targets must have the tokens' shape {tuple(tokens.shape)}, got {shape}"
            )

    # -- training / scoring under sequence parallelism ----------------------------------------
    def forward(
        self, tokens: torch.Tensor, sp: SeqParallel | None = None, gather_output: bool = True
    ) -> torch.Tensor | SeqTensor:
        """Next-byte logits for replicated ``tokens`` ``[B, L]``.

        Returns the replicated ``[B, L, vocab]`` logits, or (``gather_output=False``) this
        rank's shard of them as a :class:`SeqTensor`, for :func:`lm_loss`. Inputs are validated
        on every rank of the SP group together (a bad input raises on all of them).
        """
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"tokens": tokens}, check=lambda: self.check_tokens(tokens), what="ByteLM inputs"
        )
        return self._forward(tokens, sp, gather_output)

    def _forward(
        self, tokens: torch.Tensor, sp: SeqParallel, gather_output: bool
    ) -> torch.Tensor | SeqTensor:
        length = tokens.shape[1]
        act = sp.enter(tokens.long(), SEQ_DIMS, self.stages)  # [B, L_local] bytes of this rank
        x = self.embed(act.tensor)
        if self.pos is not None:
            x = x + sp.shard_like(self.pos.weight[:length], act, axes={"l": 0})
        act = act.with_tensor(x)
        rope = None
        if self.config.position == "rope":
            rope = rotary_table(length, self.config.head_dim, self.config.rope_base)
            rope = rope.to(x.device)
        for i, block in enumerate(self.blocks):
            with comm_region(f"block{i}"):
                if self.config.checkpoint and torch.is_grad_enabled():
                    act = checkpoint(block, act, rope, sp, use_reentrant=False)
                else:
                    act = block(act, rope, sp)
        act = act.with_tensor(self.head(self.norm(act.tensor)))
        return sp.exit(act) if gather_output else act

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, sp: SeqParallel | None = None
    ) -> torch.Tensor:
        """This rank's cross-entropy (nats per byte) under the gradient contract.

        Its mean over the SP group is the mean cross-entropy of the whole batch.
        """
        sp = sp or SeqParallel()
        sp.agree_entry(
            {"tokens": tokens},
            check=lambda: self.check_tokens(tokens, targets),
            what="ByteLM inputs",
        )
        return lm_loss(self._forward(tokens, sp, gather_output=False), targets, sp)

    # -- generation (one process) -------------------------------------------------------------
    @torch.no_grad()
    def decode(
        self, tokens: torch.Tensor, cache: list[dict[str, torch.Tensor]], start: int
    ) -> torch.Tensor:
        """Logits of new ``tokens`` ``[B, T]`` at positions ``start …``, given (and
        extending) the per-block KV ``cache`` of the ``start`` tokens before them."""
        length = tokens.shape[1]
        x = self.embed(tokens)
        if self.pos is not None:
            if start + length > self.config.max_len:
                raise ValueError(
                    f"position {start + length - 1} is beyond the learned position table "
                    f"(max_len={self.config.max_len})"
                )
            x = x + self.pos.weight[start : start + length]
        rope = None
        if self.config.position == "rope":
            rope = rotary_table(length, self.config.head_dim, self.config.rope_base, start)
            rope = rope.to(x.device)
        for block, block_cache in zip(self.blocks, cache):
            x = block.decode(x, rope, block_cache)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        prompt: bytes | str,
        max_new: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> bytes:
        """Sample ``max_new`` bytes after ``prompt`` (one process, KV cache); returns them.

        ``temperature`` 0 picks the most likely byte; ``top_k`` keeps the k likeliest. The
        draws come from ``generator`` only (the global RNG is not touched when it is given).
        """
        if isinstance(prompt, str):
            prompt = prompt.encode("utf-8")
        if not prompt:
            raise ValueError("generate needs a prompt of at least one byte")
        if max_new < 0 or temperature < 0:
            raise ValueError(
                f"need max_new >= 0 and temperature >= 0, got {max_new}, {temperature}"
            )
        was_training = self.training
        self.eval()
        device = self.embed.weight.device
        tokens = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
        cache: list[dict[str, torch.Tensor]] = [{} for _ in self.blocks]
        logits = self.decode(tokens, cache, 0)[:, -1]
        out: list[int] = []
        for i in range(max_new):
            byte = sample_next(logits.float(), temperature, top_k, generator)
            out.append(int(byte))
            if i + 1 < max_new:
                logits = self.decode(byte.view(1, 1), cache, len(prompt) + i)[:, -1]
        self.train(was_training)
        return bytes(out)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One byte from ``logits`` ``[1, vocab]``: greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits[0].argmax()
    logits = logits[0] / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=generator)[0].to(logits.device)


def lm_loss(logits: SeqTensor, targets: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """Cross-entropy of this rank's logit shard against its rows of replicated ``targets``
    ``[B, L]``, normalised with :func:`~dspzoo.core.sp_mean` (gradient contract)."""
    mine = sp.shard_like(targets, logits)
    ce = F.cross_entropy(
        logits.tensor.flatten(0, -2).float(), mine.flatten().long(), reduction="none"
    )
    return sp_mean(ce, sp.group)

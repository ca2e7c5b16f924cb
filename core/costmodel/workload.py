"""A model config plus a workload → the shapes every cost formula needs.

A :class:`Workload` is the cost model's whole view of one training (or inference) step: the
batch, the sequence dims and their lengths, the width, heads and key/value heads, the MLP
width, and the model's layers as the *same* :class:`~dspzoo.core.parallel.plan.Stage` s the runtime
plans with — each annotated with what runs inside it (:class:`StageSpec`: a self-attention
over which dims, how many Megatron linear pairs, a cross-attention, an MLP). Nothing here
imports torch modules of the models: shapes come from the config dataclasses alone, so the
720M/3B configs cost nothing to describe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..parallel.layout import shard_sizes
from ..parallel.methods.scan import ScanShape
from ..parallel.plan import Stage

# family -> builder(name, config, *, batch, frames, spatial, seq_len, context, itemsize, params)
_BUILDERS: dict[str, Callable[..., Workload]] = {}


def register_workload(family: str, builder: Callable[..., Workload]) -> None:
    """Let :func:`workload_for` (and ``dspzoo plan``) describe the models of ``family``.

    ``builder(name, config, *, batch, frames, spatial, seq_len, context, itemsize, params)``
    returns the :class:`Workload` of one step (the arguments ``workload_for`` was given; a
    builder raises ``ValueError`` naming the ones its family needs).
    """
    _BUILDERS[family] = builder


@dataclass(frozen=True)
class HeadScanSaved:
    """What one scan mixer saves for backward under the head all-to-all, per line of the batch.

    A rank keeps the parts of the mixer that run on its segment (``L_r`` tokens: projections,
    conv, gate, norm) and those that run on the whole sequence (``L`` tokens) for its ``H_r``
    of the ``heads`` scan heads (the all-to-all's output, the scan's own tensors, ``B``/``C``
    gathered for local use). Per line: ``token`` per local token, ``line`` once (the conv
    halo), ``whole`` per whole-sequence token (the gathered ``B``/``C``), ``whole_head`` per
    whole token and head of the rank, ``line_head`` per head (an initial state). A chunked scan
    (``chunk`` ``Q`` > 0) adds, per head of the rank, the terms of
    :func:`~dspzoo.core.parallel.methods.scan.mixer_saved_elements` over the whole line:
    ``padded_head`` per token padded to whole chunks of ``Q' = min(Q, L)``, ``square_head`` per
    padded token and chunk position, ``batched_head`` per padded token with several chunks and heads (the
    einsums' copies that batch them; one chunk or one head is a view),
    ``state_head`` per chunk state (``2k + 1`` for ``k`` chunks), ``decay_head`` per pair of
    chunk boundaries. Tensors of the parameters alone (``A`` of the rank's heads) are not
    counted, as for one process.
    """

    token: float
    line: float
    whole: float
    whole_head: float
    line_head: float = 0.0
    chunk: int = 0
    padded_head: float = 0.0
    square_head: float = 0.0
    batched_head: float = 0.0
    state_head: float = 0.0
    decay_head: float = 0.0

    def elements(self, seq: tuple[int, ...] | list[int], heads: int, rank: int) -> float:
        """Elements rank ``rank`` saves per line when the line's ``sum(seq)`` tokens are split
        ``seq`` over the ranks and the ``heads`` scan heads balanced over them."""
        n, length = len(seq), sum(seq)
        if length <= 0:
            return 0.0
        mine = shard_sizes(heads, n)[rank]
        total = seq[rank] * self.token + self.line + mine * self.line_head
        total += length * (self.whole + mine * self.whole_head)
        if self.chunk > 0:
            q = min(self.chunk, length)
            chunks = -(-length // q)
            padded = chunks * q
            per_head = padded * (self.padded_head + q * self.square_head)
            per_head += padded * self.batched_head if chunks > 1 and mine > 1 else 0.0
            per_head += (2 * chunks + 1) * self.state_head + (chunks + 1) ** 2 * self.decay_head
            total += mine * per_head
        return float(total)


@dataclass(frozen=True)
class StageSpec:
    """One stage of one layer, as the runtime meets it.

    Attributes:
        stage: the planner's :class:`Stage` (its ``name`` is what ``sp.to_stage`` is called with).
        attention: the dims its self-attention attends over (``()``: no self-attention).
        causal: its self-attention is causal (``None``: as its ``stage`` declares, or the
            workload's ``causal``; see :meth:`Workload.stage_causal`).
        tp_pairs: Megatron linear pairs (column → row) it runs under ``megatron_sp``.
        cross: it holds a cross-attention to replicated conditioning tokens.
        mlp: it holds the token-wise MLP.
        adaln: the attention/MLP input is adaLN-modulated and the output gated (video DiTs).
        pre_norm: the attention and MLP are those of a pre-norm transformer block (the text
            domain's ``Block``: LayerNorm, q and k/v, attention, projection added to the
            residual; LayerNorm, up, GELU, down), whose saved tensors the activation memory
            counts as such (ByteLM's layers, the hybrid LM's attention layers).
        scan_over: the dims its selective scan runs over, in order (``()``: no scan).
        scan: the scan mixer's :class:`~dspzoo.core.parallel.methods.scan.ScanShape` for one
            line (``seq`` and ``batch`` are filled in per plan: ``mixer.scan_shape(1, ())``).
        scan_heads_saved: what the mixer saves under the head all-to-all
            (:class:`HeadScanSaved`; ``None``: counted as one process on the local tokens).
        scan_routes: mixers run per token (a ``cross`` order's 4 routes, a circular scan's
            ring of ``X`` columns: ``X`` lines of ``X`` tokens per ring), each over the stage's
            dims whole, for the activation memory.
    """

    stage: Stage
    attention: tuple[str, ...] = ()
    causal: bool | None = None
    tp_pairs: int = 0
    cross: bool = False
    mlp: bool = False
    adaln: bool = True
    pre_norm: bool = False
    scan_over: tuple[str, ...] = ()
    scan: ScanShape | None = None
    scan_routes: int = 1
    scan_heads_saved: HeadScanSaved | None = None

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class Workload:
    """Shapes of one step of one model (see the module docstring).

    ``lengths`` are token lengths (after patching). ``in_width`` / ``exit_width`` are the
    elements per token entering the model and gathered at its exit (patch dims for video,
    1 byte id and ``vocab`` logits for text). ``context`` conditioning tokens feed every
    cross-attention. ``itemsize`` is the activation dtype's bytes (2 for bf16 training).
    ``stream_itemsize``: the bytes of the residual stream where they differ (``None``: the
    same). Under autocast with fp32 parameters (``--mixed-precision bf16``) the stream stays
    fp32 (``x + block(x)`` adds a bf16 branch to fp32 ``x``), so what is sent of it — DSP's
    switches, a gather for local use, Megatron-SP's all-gather of a norm's output and its
    backward reduce-scatter — is 4 bytes while the linears' outputs are 2
    (:attr:`residual_itemsize`).
    ``exit_last``: dims of which the head runs on, and the exit gathers, the last row alone
    (weather: ``t``, the forecast reads the last state's outputs only).
    ``loss_on_shard``: training computes its loss on each rank's output shard
    (``gather_output=False``: the LMs' cross-entropy, the video DiTs' flow MSE), so a training
    step sends no exit all-gather; ``False`` where training gathers the output first (the
    weather forecast's replicated MSE). Inference gathers the output either way.
    """

    name: str
    family: str
    batch: int
    dims: tuple[str, ...]
    lengths: tuple[int, ...]
    hidden: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    layers: tuple[tuple[StageSpec, ...], ...]
    period: tuple[Stage, ...]
    in_width: int
    exit_width: int
    causal: bool = False
    context: int = 0
    cond_dim: int = 0
    params: int = 0
    itemsize: int = 4
    stream_itemsize: int | None = None
    exit_last: tuple[str, ...] = ()
    loss_on_shard: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def residual_itemsize(self) -> int:
        """Bytes per element of the residual stream (``stream_itemsize``, else ``itemsize``)."""
        return self.itemsize if self.stream_itemsize is None else self.stream_itemsize

    @property
    def tokens(self) -> int:
        """Tokens per sample (the product of the sequence lengths)."""
        return math.prod(self.lengths)

    @property
    def exit_tokens(self) -> int:
        """Tokens per sample the head runs on and the exit gathers (see ``exit_last``)."""
        return math.prod(1 if d in self.exit_last else n for d, n in zip(self.dims, self.lengths))

    @property
    def depth(self) -> int:
        return len(self.layers)

    def stage_causal(self, spec: StageSpec) -> bool:
        """Whether stage ``spec``'s self-attention is causal: its own ``causal``, else its
        planner stage's (``Stage.causal``, what the planner prices with), else the
        workload's."""
        if spec.causal is not None:
            return spec.causal
        return spec.stage.causal or self.causal

    def length(self, dim: str) -> int:
        return self.lengths[self.dims.index(dim)]

    def with_(self, **changes: Any) -> Workload:
        """A copy with fields replaced (e.g. ``itemsize=2``, ``batch=4``)."""
        return replace(self, **changes)


def workload_builder(family: str) -> Callable[..., Workload]:
    """The builder registered for ``family`` (a clear error when none is)."""
    try:
        return _BUILDERS[family]
    except KeyError:
        raise ValueError(
            f"the cost model does not describe the {family!r} family yet: its domain registers "
            f"a builder with dspzoo.core.costmodel.workload.register_workload"
        ) from None

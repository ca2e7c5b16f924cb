"""Exact per-rank communication, FLOPs and memory of one step, per strategy and SP size.

**Bytes.** :func:`comm_bytes` walks a :class:`~.workload.Workload` layer by layer under the plan
the runtime itself would make (``get_strategy(name).plan(...)``), starting sharded on the
plan's entry dim, and adds every collective the runtime issues, with the tracer's conventions
(:mod:`dspzoo.core.parallel.trace`: bytes *sent* by this rank to other ranks, payload only):

* a DSP switch ``a → b`` of ``[B, …, C]`` on rank ``r``: ``a_r·(L_b − b_r)·rest·C`` elements
  forward, ``b_r·(L_a − a_r)·rest·C`` backward (``a_r``, ``b_r`` its balanced shards);
* Ulysses: one all-to-all of ``[q|k|v]`` (q and ``[k|v]`` for KV-aligned GQA) to heads and one
  of the output back, and their reverses backward, with the per-rank sequence and head splits
  (an attended sequence that is not balanced over the ranks, e.g. ``T·S`` flattened with ``S``
  sharded, is padded to the longest rank's rows, as the implementation does);
* Ring: ``p2p`` sends of the K and V blocks of steps ``0 … N−2`` forward; backward the same plus
  the ``dK``/``dV`` accumulators of steps ``0 … N−1`` in the statistics dtype (fp32, fp64 for
  fp64 inputs);
* LSS: one all-gather of ``[k|v]`` forward (``N−1`` padded chunks), one reduce-scatter of the
  same size backward;
* USP (``U × R``): three Ulysses switches (q, k, v) and the output's inside ``U``, Ring across
  ``R`` on the ring segments;
* Megatron-SP: per linear pair an all-gather and a reduce-scatter of the stage's input, forward
  and backward (``N−1`` padded chunks each);
* the exit all-gather of the output (``exit_width`` per token, padded chunk; one row of each
  ``exit_last`` dim).

The result is keyed ``(op, phase)`` like ``CommTracer.total_bytes(op, phase)``; the tests
compare it with the tracer on every rank, exactly.

**FLOPs** (:func:`step_flops`): matmul FLOPs of the forward (``2·m·n·k`` per matmul, attention
``4·B·Lq·Lk·H·D``, halved when causal), a step being forward + backward = 3× forward (4× with
activation checkpointing); per rank divided by ``N`` (the busiest rank's share for uneven
shards). **Memory**: :func:`activation_bytes` (what autograd saves, see its docstring) and
:func:`model_state_bytes` (parameters, gradients, Adam states with ZeRO-1/2/3 / FSDP sharding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..parallel.layout import shard_sizes
from ..parallel.methods.registry import (
    AttentionShape,
    CommCount,
    gather_bytes,
    get_method,
    megatron_pair_bytes,
    stats_itemsize,
    switch_bytes,
)
from ..parallel.methods.ring import zigzag_lengths
from ..parallel.methods.scan import mixer_saved_elements
from ..parallel.plan import Plan
from ..parallel.strategies import Strategy, get_strategy
from .workload import StageSpec, Workload

OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p")
PHASES = ("forward", "backward")


# -- plans -----------------------------------------------------------------------------------
def make_plan(
    workload: Workload, strategy: str | Strategy, sp_size: int, dim: str | None = None
) -> Plan:
    """The plan the runtime makes for ``workload`` under ``strategy`` (a name, or a strategy
    object such as ``Embedded("state_passing")``) at ``sp_size``."""
    if isinstance(strategy, str):
        strategy = get_strategy(strategy, dim)
    return strategy.plan(workload.dims, workload.lengths, workload.period, sp_size)


def _sizes(length: int, n: int, layout: str) -> list[int]:
    return zigzag_lengths(length, n) if layout == "zigzag" else shard_sizes(length, n)


# -- the walk --------------------------------------------------------------------------------
def comm_bytes(
    workload: Workload,
    strategy: str | Plan,
    sp_size: int,
    rank: int = 0,
    *,
    ulysses_size: int = 1,
    dim: str | None = None,
    exit_gather: bool = True,
) -> CommCount:
    """Bytes and collectives rank ``rank`` sends in one forward + backward (module doc).

    ``strategy``: a strategy name (planned as the runtime plans it) or a :class:`Plan`.
    ``ulysses_size``: USP's Ulysses degree (the mesh's; 1 = pure ring).
    """
    out = CommCount()
    n = sp_size
    if n == 1:
        return out
    plan = strategy if isinstance(strategy, Plan) else make_plan(workload, strategy, n, dim)
    isz, b, c = workload.itemsize, workload.batch, workload.hidden
    stream = workload.residual_itemsize  # what switches and gathers of the stream carry
    lengths = dict(zip(workload.dims, workload.lengths))
    layout = plan.layout

    def sizes(d: str) -> list[int]:
        return _sizes(lengths[d], n, layout)

    def rest(exclude: tuple[str, ...]) -> int:
        return b * math.prod(v for k, v in lengths.items() if k not in exclude)

    cur, gathered = plan.entry, False
    for layer in workload.layers:
        for spec in layer:
            step = plan.step_for(spec.name)
            if step.sharded != cur and not gathered:
                other = rest((cur, step.sharded)) * c * stream
                switch_bytes(out, sizes(cur), sizes(step.sharded), rank, other)
            cur = step.sharded
            method = get_method(step.method)
            gathered = method.name == "gather"
            if gathered:
                gather_bytes(out, sizes(cur), rest((cur,)) * c * stream)
            elif method.tensor_parallel:
                for _ in range(spec.tp_pairs):
                    megatron_pair_bytes(out, sizes(cur), rest((cur,)) * c, isz, stream)
            elif spec.attention and cur in spec.attention and method.name != "local":
                attention_bytes(
                    out, workload, spec, step.method, cur, sizes(cur), rank, ulysses_size
                )
            elif spec.scan is not None and cur in spec.scan_over and method.name != "local":
                scan_bytes(out, workload, spec, step.method, sizes(cur), rank)
    if exit_gather:
        out.add("all_gather", "forward", exit_gather_bytes(workload, plan, n))
    return out


def exit_gather_bytes(workload: Workload, plan: Plan, sp_size: int) -> int:
    """Bytes every rank sends in the exit all-gather of the output (the same on every rank:
    the padded chunk of the dim sharded after the last stage, ``exit_width`` per token, one row
    of each ``exit_last`` dim); 0 on one process."""
    n = sp_size
    if n == 1:
        return 0
    cur = plan.entry
    for layer in workload.layers:
        for spec in layer:
            cur = plan.step_for(spec.name).sharded
    lengths = dict(zip(workload.dims, workload.lengths))
    kept = {d: 1 if d in workload.exit_last else v for d, v in lengths.items()}
    z = _sizes(kept[cur], n, plan.layout)
    others = workload.batch * math.prod(v for d, v in kept.items() if d != cur)
    return (n - 1) * max(z) * others * workload.exit_width * workload.itemsize


def attention_bytes(
    out: CommCount,
    workload: Workload,
    spec: StageSpec,
    method: str,
    sharded: str,
    sharded_sizes: list[int],
    rank: int,
    ulysses_size: int = 1,
) -> None:
    """Bytes of one self-attention over ``spec.attention`` with ``sharded`` split."""
    lengths = dict(zip(workload.dims, workload.lengths))
    over = spec.attention
    per_row = math.prod(lengths[d] for d in over if d != sharded)
    seq = [s * per_row for s in sharded_sizes]
    bf = workload.batch * math.prod(v for k, v in lengths.items() if k not in over)
    shape = AttentionShape(
        tuple(seq),
        bf,
        workload.heads,
        workload.kv_heads,
        workload.head_dim,
        workload.itemsize,
        ulysses_size,
        workload.stage_causal(spec),
    )
    get_method(method).attention_bytes(out, shape, rank)


def scan_bytes(
    out: CommCount,
    workload: Workload,
    spec: StageSpec,
    method: str,
    sharded_sizes: list[int],
    rank: int,
) -> None:
    """Bytes of one scan mixer over ``spec.scan_over`` (the sharded dim outermost), in the
    workload's itemsize (the summaries in fp32, fp64 for fp64)."""
    lengths = dict(zip(workload.dims, workload.lengths))
    per_row = math.prod(lengths[d] for d in spec.scan_over[1:])
    lines = workload.batch * math.prod(v for k, v in lengths.items() if k not in spec.scan_over)
    isz = workload.itemsize
    seq = tuple(s * per_row for s in sharded_sizes)
    shape = replace(
        spec.scan, seq=seq, batch=lines, itemsize=isz, summary_itemsize=stats_itemsize(isz)
    )
    get_method(method).scan_bytes(out, shape, rank)


def comm_bytes_all_ranks(
    workload: Workload, strategy: str | Plan, sp_size: int, **kwargs
) -> list[CommCount]:
    """:func:`comm_bytes` of every rank."""
    return [comm_bytes(workload, strategy, sp_size, r, **kwargs) for r in range(sp_size)]


# -- Ulysses over the flattened sequence (DSP's reference code; a model, not traced) --------
def ulysses_flat_bytes(workload: Workload, sp_size: int) -> int:
    """Per-rank bytes of one step of Ulysses as DSP's reference OpenSora code runs it.

    The flattened ``T·S`` sequence is sharded, and *both* the spatial and the temporal
    attention of every axial layer are wrapped in Ulysses' all-to-alls: ``4`` activation-sized
    all-to-alls per attention forward (q, k, v, out), 8 per layer, the same backward. Evenly
    divisible shapes assumed (the reference code requires it).
    """
    n = sp_size
    e = workload.batch * workload.tokens * workload.hidden / n * workload.itemsize
    per_attention = 4 * e * (n - 1) / n
    attentions = sum(1 for layer in workload.layers for spec in layer if spec.attention)
    return int(2 * attentions * per_attention)  # forward + backward


# -- FLOPs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one step (whole model, all ranks), split by kind."""

    linear: float
    attention: float

    @property
    def forward(self) -> float:
        return self.linear + self.attention

    def step(self, recompute: bool = False) -> float:
        """Forward + backward (backward = 2× forward; +1 forward with checkpointing)."""
        return self.forward * (4 if recompute else 3)


def stage_flops(workload: Workload, spec: StageSpec) -> Flops:
    """Matmul FLOPs of one stage's forward over the whole batch (see the module doc)."""
    wl = workload
    b, c, bt = wl.batch, wl.hidden, wl.batch * wl.tokens
    lengths = dict(zip(wl.dims, wl.lengths))
    kv_width = 2 * wl.kv_heads * wl.head_dim
    linear = attention = 0.0
    if spec.attention:
        linear += 2.0 * bt * c * (c + kv_width) + 2.0 * bt * c * c
        length = math.prod(lengths[d] for d in spec.attention)
        attn = 4.0 * bt * length * c
        attention += attn / 2 if wl.stage_causal(spec) else attn
    if spec.cross and wl.context:
        linear += 2.0 * bt * c * c * 2 + 2.0 * b * wl.context * c * 2 * c
        attention += 4.0 * bt * wl.context * c
    if spec.mlp:
        linear += 2.0 * bt * c * wl.mlp_hidden * 2
    if spec.scan is not None:  # a Mamba mixer: its projections, conv and scan
        linear += bt * spec.scan.flops_per_token
    return Flops(linear, attention)  # per-sample modulation (adaLN): negligible


def _ends_flops(workload: Workload) -> float:
    bt, head = workload.batch * workload.tokens, workload.batch * workload.exit_tokens
    return 2.0 * bt * workload.in_width * workload.hidden + 2.0 * head * workload.hidden * (
        workload.exit_width
    )


def forward_flops(workload: Workload) -> Flops:
    """Matmul FLOPs of one forward over the whole batch (see the module doc)."""
    linear, attention = _ends_flops(workload), 0.0
    for layer in workload.layers:
        for spec in layer:
            f = stage_flops(workload, spec)
            linear, attention = linear + f.linear, attention + f.attention
    return Flops(linear, attention)


def _share(workload: Workload, plan: Plan, dim: str) -> float:
    """The busiest rank's share of ``dim`` (``1/N`` when balanced, ``1`` at most)."""
    length = workload.length(dim)
    return max(_sizes(length, plan.sp_size, plan.layout)) / length if length else 1.0


def imbalance(workload: Workload, plan: Plan) -> float:
    """Busiest rank's share of the tokens over the mean share, over the plan's sharded dims."""
    return max(1.0, *(_share(workload, plan, s.sharded) * plan.sp_size for s in plan.steps))


def flops_per_rank(workload: Workload, plan: Plan | None, recompute: bool = False) -> float:
    """Step FLOPs of the busiest rank: every stage at the share of its planned sharded dim (a
    stage on a dim shorter than ``N`` or not divisible by it keeps ranks waiting), the model's
    ends at the entry dim's share."""
    mult = 4 if recompute else 3
    if plan is None or plan.sp_size == 1:
        return forward_flops(workload).forward * mult
    total = _ends_flops(workload) * _share(workload, plan, plan.entry)
    for layer in workload.layers:
        for spec in layer:
            step = plan.step_for(spec.name)
            total += stage_flops(workload, spec).forward * _share(workload, plan, step.sharded)
    return total * mult


# -- memory ----------------------------------------------------------------------------------
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v (mixed precision)


def model_state_bytes(
    params: int,
    *,
    param_itemsize: int = 2,
    grad_itemsize: int = 2,
    optimizer_bytes: int = OPTIMIZER_BYTES_PER_PARAM,
    shard: int = 1,
    zero: int = 0,
    tp: int = 1,
) -> float:
    """Parameters + gradients + optimizer state per GPU.

    ``zero``: 0 (none), 1 (optimizer sharded), 2 (+ gradients), 3 (+ parameters; = FSDP full
    shard), each over ``shard`` ranks (usually the data-parallel world). ``tp``: tensor-parallel
    degree (Megatron-SP shards the block weights over the SP group).
    """
    p = params / tp
    opt = p * optimizer_bytes / (shard if zero >= 1 else 1)
    grads = p * grad_itemsize / (shard if zero >= 2 else 1)
    weights = p * param_itemsize / (shard if zero >= 3 else 1)
    return weights + grads + opt


def _stage_elements(
    wl: Workload, spec: StageSpec, method: str, n: int, rank: int
) -> tuple[float, float]:
    """Saved elements of one stage: ``(per local token, per full-sequence token)``.

    The second term is non-zero only under Megatron-SP, whose column linears see the whole
    sequence (see :func:`activation_bytes`).
    """
    c, h, hkv, d = wl.hidden, wl.heads, wl.kv_heads, wl.head_dim
    ckv = hkv * d
    tp = get_method(method).tensor_parallel and spec.tp_pairs
    local = full = 0.0
    if spec.attention:
        if spec.pre_norm:
            # x, LN out (qkv input), rotated q and k, v's storage, out (proj input), lse
            local += 2 * c + 2 + (c + ckv) + 2 * ckv + c + h
        elif tp:
            hr = shard_sizes(h, n)[rank]
            local += 3 * c + 2  # x, LN out, gated projection output
            full += c + 5 * d * hr + hr  # gathered input, q k v, out, proj input, lse
        else:
            # x, LN out, modulated input, q k v, out, proj input (a copy when the attended
            # dims are folded out of place), proj output (gated), lse
            local += 9 * c + 2 + h
        local += get_method(method).saved_elements_per_token(
            ckv, n, q_width=h * d, heads=h, causal=wl.stage_causal(spec)
        )
    if spec.scan is not None:  # the block around the mixer (the mixer: _scan_elements)
        if spec.adaln:  # LayerNorm input and statistics, its output, the mixer output (gated)
            local += 3 * c + 2
        else:  # RMSNorm: the input, its statistic, the normalised input
            local += 2 * c + 1
    if spec.cross and wl.context:
        local += 3 * c + h  # q input, q, out
    if spec.mlp:
        if spec.pre_norm:
            local += 2 * c + 2 + 2 * wl.mlp_hidden  # x, LN out, up out, gelu out
        elif tp:
            local += 3 * c + 2  # x, LN out, gated output
            full += c + 2 * shard_sizes(wl.mlp_hidden, n)[rank]  # gathered input, hidden
        else:
            local += 4 * c + 2 + 2 * wl.mlp_hidden
    return local, full


def _scan_elements(
    wl: Workload, spec: StageSpec, method: str, sharded: str | None, sizes: list[int], rank: int
) -> float:
    """Elements the mixers of scan stage ``spec`` save on rank ``rank``, every line of the
    batch: ``scan_routes`` mixers per line of the scanned dims (``scan_over``, or the
    stage's dims for a generic stage), with the ``sharded`` dim at its local size, plus what
    the method keeps beyond one process (state passing's summaries and correction); under the
    head all-to-all (a method that ``scans_whole_lines``), the mixer's
    :class:`~.workload.HeadScanSaved` instead."""
    full = dict(zip(wl.dims, wl.lengths))
    local = dict(full)
    if sharded is not None and method != "gather":
        local[sharded] = sizes[rank]
    over = spec.scan_over or spec.stage.mixes
    length = math.prod(local[d] for d in over)
    lines = wl.batch * math.prod(v for d, v in local.items() if d not in over)
    if sharded in spec.scan_over and method not in ("local", "gather"):
        per_row = math.prod(full[d] for d in spec.scan_over[1:])
        seq = tuple(s * per_row for s in sizes)
        if get_method(method).scans_whole_lines and spec.scan_heads_saved is not None:
            # the scan runs on whole sequences for the rank's heads: its own count
            saved = spec.scan_heads_saved.elements(seq, spec.scan.heads, rank)
            return spec.scan_routes * lines * saved
        shape = replace(spec.scan, seq=seq, batch=lines)
        extra = get_method(method).scan_saved_elements(shape, rank)
        return spec.scan_routes * lines * mixer_saved_elements(spec.scan, length) + extra
    return spec.scan_routes * lines * mixer_saved_elements(spec.scan, length)


def activation_bytes(
    workload: Workload, strategy: str | Plan = "dsp", sp_size: int = 1, rank: int = 0
) -> float:
    """Bytes autograd saves for backward on rank ``rank`` in one forward (parameters excluded).

    Counted per *local* token of each stage (the rank's shard of the activation), per layer,
    as this repository's modules save them: the residual input, LayerNorm statistics (two
    fp32 values per token) and output, the modulated input of the adaLN models, q/k/v, the
    attention output and its log-sum-exp (one per head), the projection's input and (gated
    models) output; the MLP's input, hidden pre- and post-activation and output; a cross-
    attention's query input, query and output; a scan stage's (Mamba) norm and residual around
    its mixers (adaLN models: LayerNorm input, statistics and output and the gated mixer
    output; LMs: RMSNorm input, statistic and normalised input) and, per line of the scanned
    dims at their local length, what each mixer saves (:class:`ScanShape`'s ``saved_*``, from
    the mixer's config: projections, conv, the Mamba-1 states per token, the Mamba-2 SSD's
    chunk blocks and chunk states; :func:`mixer_saved_elements`) times its routes; state
    passing adds its summaries and correction (the method's ``scan_saved_elements``); under the
    head all-to-all a mixer saves its projections and conv for the local tokens and its scan
    for the whole sequence and the rank's heads (the stage's ``scan_heads_saved``,
    :class:`~.workload.HeadScanSaved`). Per method: LSS adds the gathered K and V of
    the other ranks; Megatron-SP saves the gathered full-sequence input of each column linear
    (``N·C`` per local token) in place of the local one. Ulysses, Ring, DSP save the same
    amount as one process on their shard. Plus the model's ends: patch / byte input, the final
    LayerNorm and output linear input; conditioning tokens and their K/V per cross-attention.
    Not counted: per-sample modulation vectors, activation checkpointing (ByteLM's and the
    Mamba LMs' ``checkpoint=True`` keeps only each block's input), temporary buffers of
    collectives, tensors derived from the parameters alone (a mixer's ``A``), the scans' fp32
    state under a bf16 ``itemsize`` (everything is counted at ``itemsize``).
    """
    n = sp_size
    sizes: list[int] = []
    if n == 1:
        plan = None
        local = workload.tokens
    else:
        plan = strategy if isinstance(strategy, Plan) else make_plan(workload, strategy, n)
        local = None
    c = workload.hidden
    elements = 0.0
    for layer in workload.layers:
        for spec in layer:
            method = "local"
            if plan is not None:
                step = plan.step_for(spec.name)
                method = step.method
                sizes = _sizes(workload.length(step.sharded), n, plan.layout)
                local = workload.tokens // workload.length(step.sharded) * sizes[rank]
            if workload.extra.get("checkpoint"):
                continue
            per_local, per_full = _stage_elements(workload, spec, method, n, rank)
            elements += workload.batch * (local * per_local + workload.tokens * per_full)
            if spec.scan is not None:
                sharded = None if plan is None else step.sharded
                elements += _scan_elements(workload, spec, method, sharded, sizes, rank)
            if spec.cross and workload.context:
                elements += workload.batch * workload.context * 2 * c  # its K and V
    head_local = workload.exit_tokens  # the tokens the head runs on (one process)
    if plan is not None:
        last = plan.step_for(workload.layers[-1][-1].name).sharded
        sizes = _sizes(workload.length(last), n, plan.layout)
        if last not in workload.exit_last:  # else one (candidate) row on every rank
            head_local = workload.exit_tokens // workload.length(last) * sizes[rank]
        first = _sizes(workload.length(plan.entry), n, plan.layout)[rank]
        first_local = workload.tokens // workload.length(plan.entry) * first
    else:
        first_local = local
    ends = 2 * c + 2  # final LayerNorm input + statistics, output linear input
    if workload.family != "bytelm":
        ends += c  # the modulated input of the final linear
    elements += workload.batch * head_local * ends
    if workload.extra.get("checkpoint"):
        elements += workload.batch * first_local * c * workload.depth  # block inputs
    start = workload.in_width
    itemsize = workload.itemsize
    total = elements * itemsize
    if workload.family == "bytelm":
        total += workload.batch * first_local * 8  # int64 byte ids (the embedding's input)
    else:
        total += workload.batch * first_local * start * itemsize  # patches (x_embed input)
        if workload.context:
            total += workload.batch * workload.context * (workload.cond_dim + 2 * c) * itemsize
    return total


# -- memory-bound work (device-memory traffic) -----------------------------------------------
def elementwise_bytes(
    workload: Workload,
    strategy: str | Plan = "dsp",
    sp_size: int = 1,
    rank: int = 0,
    *,
    training: bool = True,
    recompute: bool = False,
) -> float:
    """Device-memory bytes the element-wise work of one step moves on rank ``rank``.

    The norms, modulation, activations, residual adds, gates and the reshapes around the
    attention are memory-bound: every tensor the forward saves for backward
    (:func:`activation_bytes`, without checkpointing) was written once and read once more
    in the forward (``2×``); the backward reads it and writes and reads its gradient
    (``4×`` more); checkpointing runs the forward again (``+2×``). Inference: ``2×``.
    """
    extra = {k: v for k, v in workload.extra.items() if k != "checkpoint"}
    act = activation_bytes(workload.with_(extra=extra), strategy, sp_size, rank)
    if not training:
        return 2.0 * act
    return (8.0 if recompute else 6.0) * act


def unfused_score_bytes(
    workload: Workload, sp_size: int = 1, *, training: bool = True, recompute: bool = False
) -> float:
    """Device-memory bytes of the attention score matrices of one step per rank, where no
    fused attention kernel exists (Volta): the forward writes the scores, reads them in the
    softmax, writes the probabilities and reads them in the second matmul (4 passes of
    ``B·H·Lq·Lk`` elements, half when causal, split over the ranks as the attention FLOPs
    are); the backward twice that; checkpointing repeats the forward.

    The elements per rank are the forward attention FLOPs ``/ (4·head_dim)`` ÷ N — the
    same for every method that balances the attention work.
    """
    elements = forward_flops(workload).attention / (4.0 * workload.head_dim) / sp_size
    passes = 4.0 * ((4 if recompute else 3) if training else 1)
    return passes * elements * workload.itemsize


def layout_copy_bytes(all_to_all_bytes: float, sp_size: int) -> float:
    """Device-memory bytes of the layout copies around all-to-alls that send
    ``all_to_all_bytes`` in all: before each, the rank's whole local tensor is packed into
    the per-peer contiguous send buffer (read + write), after it the received chunks are
    unpacked into the layout the next op wants (read + write): ``4×`` the local tensor,
    which is ``N/(N−1)`` of the bytes sent."""
    n = sp_size
    if n <= 1:
        return 0.0
    return 4.0 * all_to_all_bytes * n / (n - 1)

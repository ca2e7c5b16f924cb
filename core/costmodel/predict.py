"""Predicted step time, the recommendation (smallest SP size that fits, fastest strategy),
a printable table, and the per-stage choice behind ``strategy="auto"``.

Step time = compute + exposed communication::

    compute = FLOPs of the busiest rank / (peak · MFU)
    memory  = (element-wise bytes [+ unfused score bytes]) / HBM bandwidth
    copies  = layout-copy bytes around the all-to-alls / HBM bandwidth
    comm    = Σ over collectives NCCL latency(op, N) + bytes / bandwidth, intra- or inter-node
    step    = compute + memory + copies + (1 − overlap) · comm

(``memory`` and ``copies`` are zero on a cluster without ``hbm_bw``; the latency is
``intra_lat``/``inter_lat`` per collective on one without NCCL's constants. On a cluster whose
attention kernels were measured apart, ``attention_tflops`` (``this-cpu``), the attention's
share of the FLOPs runs at that rate and the rest at the matmul rate.)

Bytes are the exact per-rank formulas (:func:`~.formulas.comm_bytes`, the busiest rank), so
the only modelled quantities are the cluster's rates. ``ulysses_flat`` is a prediction-only
variant: Ulysses as DSP's reference OpenSora code runs it, all-to-alls around *both* attention
stages of every axial layer (8 per layer); our ``ulysses`` shards one dim and communicates
only in the attention over it (4 per axial layer; the DSP paper's Table 3 count).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..parallel.methods.registry import METHODS, get_method
from ..parallel.plan import Plan
from ..parallel.strategies.auto import auto_plan  # noqa: F401  (re-exported: strategy="auto")
from .cluster import Cluster, get_cluster
from .formulas import (
    CommCount,
    activation_bytes,
    comm_bytes,
    elementwise_bytes,
    exit_gather_bytes,
    flops_per_rank,
    forward_flops,
    layout_copy_bytes,
    make_plan,
    model_state_bytes,
    stage_flops,
    ulysses_flat_bytes,
    unfused_score_bytes,
)
from .workload import Workload

DEFAULT_STRATEGIES = ("dsp", "ulysses", "ulysses_flat", "ring", "lss", "usp", "megatron_sp")
#: the balanced variants of ring and of LSS (zigzag layouts; ring's balanced schedule and
#: LSS's lent query rows on the contiguous layout), compared by default where they matter
BALANCED_STRATEGIES = {
    "ring": ("ring_zigzag", "ring_balanced"),
    "lss": ("lss_zigzag", "lss_balanced"),
}


def default_strategies(workload: Workload) -> tuple[str, ...]:
    """The strategies ``dspzoo plan`` compares when none are named: :data:`DEFAULT_STRATEGIES`
    and, for a model with causal attention over one sequence dim, the balanced variants of ring
    and LSS (:data:`BALANCED_STRATEGIES`; the text trainer's default is ``lss_zigzag``), each
    after its contiguous one. For models with scan stages only those on the contiguous layout
    (``ring_balanced``, ``lss_balanced``): a zigzag layout makes their scans gather the
    sequence whole (``dspzoo plan --strategies`` still shows it)."""
    specs = [spec for layer in workload.layers for spec in layer]
    attends_causally = any(s.attention and workload.stage_causal(s) for s in specs)
    if not (attends_causally and len(workload.dims) == 1):
        return DEFAULT_STRATEGIES
    scans = any(spec.scan is not None for spec in specs)
    names: list[str] = []
    for name in DEFAULT_STRATEGIES:
        names.append(name)
        for variant in BALANCED_STRATEGIES.get(name, ()):
            if not scans or get_method(variant).layout == "contiguous":
                names.append(variant)
    return tuple(names)


GIB = 2**30


@dataclass(frozen=True)
class Prediction:
    """One (strategy, SP size) row of the table; bytes and memory per rank (the busiest)."""

    strategy: str
    sp: int
    flops: float
    bytes: float
    collectives: int
    activation: float
    states: float
    compute_s: float
    comm_s: float
    step_s: float
    fits: bool
    note: str = ""
    memory_s: float = 0.0
    copy_s: float = 0.0
    latency_s: float = 0.0
    same_as: tuple[str, ...] = ()  # other strategies with this plan and figures (merged rows)

    @property
    def memory(self) -> float:
        return self.activation + self.states

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategy of the row and those merged into it (:func:`merge_same_plans`)."""
        return (self.strategy, *self.same_as)

    @property
    def label(self) -> str:
        """The row's strategies, comma-separated (one word: ``dsp,ulysses,ring``)."""
        return ",".join(self.strategies)


def _busiest(counts: list[CommCount], phases: tuple[str, ...]) -> CommCount:
    """The busiest rank's counts, restricted to ``phases``."""
    best = max(counts, key=lambda c: sum(c.bytes(phase=p) for p in phases))
    out = CommCount()
    for (op, phase), (count, nbytes) in best.items():
        if phase in phases:
            out.add(op, phase, nbytes, count)
    return out


def _with_recomputation(counts: CommCount, exit_gather: int = 0) -> CommCount:
    """``counts`` plus the forward's collectives again in phase ``"recompute"``: activation
    checkpointing reruns each block's forward, its all-to-alls and gathers included, before
    that block's backward. What runs once per step outside the blocks is not rerun: the
    output's exit all-gather (``exit_gather``: its bytes, one
    of the forward's ``all_gather`` calls; 0 where the step sends none)."""
    out = CommCount()
    for (op, phase), (count, nbytes) in counts.items():
        out.add(op, phase, nbytes, count)
        if phase == "forward":
            out.add(op, "recompute", nbytes, count)
    if exit_gather:
        out.add("all_gather", "recompute", -exit_gather, -1)
    return out


def causal_work_factor(workload: Workload, plan: Plan, ulysses: int = 1) -> float:
    """The busiest rank's attention work over the average under ``plan``: each attention
    stage's FLOPs weighted by the factor of the method the plan runs it with on its layout
    when the stage is causal (:meth:`Method.causal_work_factor`; 1 when balanced, local or not
    causal). Exact where one method runs every causal stage (every 1-D model), an upper bound
    otherwise (the busiest ranks of two stages may differ)."""
    methods = {step.stage: step.method for step in plan.steps}
    total = weighted = 0.0
    for layer in workload.layers:
        for spec in layer:
            if not spec.attention:
                continue
            work = stage_flops(workload, spec).attention
            factor = 1.0
            if workload.stage_causal(spec) and spec.name in methods:
                method = get_method(methods[spec.name])
                factor = method.causal_work_factor(plan.sp_size, plan.layout, ulysses)
            total, weighted = total + work, weighted + work * factor
    return weighted / total if total else 1.0


def predict(
    workload: Workload,
    strategy: str,
    sp_size: int,
    cluster: str | Cluster = "h100-nvlink-ib",
    *,
    dp: int = 1,
    zero: int = 1,
    recompute: bool = False,
    training: bool = True,
    overlap: float | None = None,
    ulysses_size: int | None = None,
    exact_ranks: bool = True,
    micro_batching: bool = False,
) -> Prediction:
    """Predict one step of ``workload`` under ``strategy`` at SP size ``sp_size``.

    ``training=False``: forward only (inference; no optimizer state, activations not kept).
    The output's exit all-gather is counted where the step sends it
    (:func:`sends_exit_gather`): in inference, not in a training step whose loss runs on
    each rank's shard.
    ``dp``/``zero``: data-parallel ranks and the ZeRO stage sharding the model states.
    ``recompute``: activation checkpointing (one extra forward of the blocks, block inputs
    kept; their collectives are sent again, not the validation or the exit gather:
    :func:`_with_recomputation`).
    ``ulysses_size``: USP's Ulysses degree (default: the most square grid, Ulysses larger).
    ``exact_ranks``: evaluate the byte formulas on every rank (else rank 0 only: faster).
    ``micro_batching``: a training step that does not fit runs its batch in the fewest
    micro-batches that fit (:func:`micro_batches`): the same FLOPs and bytes, every
    collective's latency paid once per micro-batch (the row's note says how many).
    """
    cl = get_cluster(cluster)
    n = sp_size
    phases = ("forward", "backward") if training else ("forward",)
    note = ""
    plan: Plan | None = None
    busiest = CommCount()
    exit_bytes = 0  # the exit all-gather's bytes where the step sends it
    if strategy == "ulysses_flat":
        plan = make_plan(workload, "ulysses", n) if n > 1 else None
        attentions = sum(1 for layer in workload.layers for s in layer if s.attention)
        if n > 1:
            flat = ulysses_flat_bytes(workload, n) / 2  # per phase
            for phase in phases:
                busiest.add("all_to_all", phase, flat, 4 * attentions)
            if sends_exit_gather(workload, training):  # the reference code gathers too
                exit_bytes = exit_gather_bytes(workload, plan, n)
                busiest.add("all_gather", "forward", exit_bytes, 1)
    else:
        if n > 1:
            plan = make_plan(workload, strategy, n)
        if strategy == "usp" and ulysses_size is None:
            ulysses_size = _square_ulysses(n)
        ranks = range(n) if exact_ranks else range(1)
        exit_gather = sends_exit_gather(workload, training)
        counts = [
            comm_bytes(
                workload,
                plan or strategy,
                n,
                r,
                ulysses_size=ulysses_size or 1,
                exit_gather=exit_gather,
            )
            for r in ranks
        ]
        busiest = _busiest(counts, phases)
        if exit_gather and plan is not None:
            exit_bytes = exit_gather_bytes(workload, plan, n)
        why = plan_unsupported(plan, workload, strategy) if plan is not None else None
        if why:
            note = f"not runnable: {why}"
    if training and recompute:
        busiest = _with_recomputation(busiest, exit_bytes)
    flops = flops_per_rank(workload, plan, recompute)
    if not training:
        flops = forward_flops(workload).forward / n
    parts = forward_flops(workload)
    share = parts.attention / parts.forward if parts.forward else 0.0
    linear, attention = flops * (1 - share), flops * share
    # causal attention on a contiguous layout (ring, LSS, USP's ring, and DSP where its plan
    # runs one of them) is unbalanced: the last rank attends to every block before its own,
    # (2N − 1)/N of the average (the zigzag layouts balance it); the plan's methods say
    if plan is not None:
        attention *= causal_work_factor(workload, plan, ulysses_size or 1)
    flops = linear + attention
    nbytes, collectives = busiest.bytes(), busiest.count()
    # the attention at its own rate where it was measured apart (this-cpu), else the matmuls'
    compute = linear / cl.flops + attention / cl.attention_flops
    latency = sum(c * cl.collective_latency(op, n) for op, c in busiest.collectives().items())
    switched = busiest.bytes(op="all_to_all") if cl.switch_bw else 0.0
    comm = cl.transfer_time(nbytes - switched, n, 0) + switched / (cl.switch_bw or 1) + latency
    act_strategy = "ulysses" if strategy == "ulysses_flat" else strategy
    memory = copies = 0.0
    if cl.hbm_bw:
        traffic = elementwise_bytes(
            workload, plan or act_strategy, n, training=training, recompute=recompute
        )
        if not cl.fused_attention:
            traffic += unfused_score_bytes(workload, n, training=training, recompute=recompute)
        memory = traffic / cl.hbm_bw
        if not cl.switch_bw:  # a probed switch rate has its layout work in it
            copies = layout_copy_bytes(busiest.bytes(op="all_to_all"), n) / cl.hbm_bw
    act = activation_bytes(_recompute(workload, recompute), act_strategy, n) if training else 0.0
    if not training:
        states = workload.params * workload.itemsize / (n if strategy == "megatron_sp" else 1)
    else:
        states = model_state_bytes(
            workload.params,
            param_itemsize=workload.itemsize,
            grad_itemsize=workload.itemsize,
            shard=dp * n,
            zero=zero,
            tp=n if strategy == "megatron_sp" else 1,
        )
    budget = cl.memory_gib * GIB * 0.9
    micro = micro_batches(act, states, budget, workload.batch) if training and micro_batching else 1
    if micro > 1:  # the same bytes and FLOPs in `micro` passes: every collective `micro` times
        act /= micro
        comm += (micro - 1) * latency
        latency *= micro
        collectives *= micro
        note = note or f"{micro} micro-batches"
    fits = act + states <= budget
    hidden = cl.overlap if overlap is None else overlap
    step = compute + memory + copies + (1 - hidden) * comm
    return Prediction(
        strategy,
        n,
        flops,
        nbytes,
        collectives,
        act,
        states,
        compute,
        comm,
        step,
        fits,
        note,
        memory_s=memory,
        copy_s=copies,
        latency_s=latency,
    )


def sends_exit_gather(workload: Workload, training: bool) -> bool:
    """Whether one step all-gathers the model's output at its exit: inference does (the
    samplers, forecasts and evaluation take the replicated output), a training step only when
    its loss needs the whole output (``workload.loss_on_shard`` false, e.g. the weather
    forecast's MSE); the LMs and video DiTs train on each rank's shard
    (``gather_output=False``) and send no exit gather."""
    return not (training and workload.loss_on_shard)


def micro_batches(activation: float, states: float, budget: float, batch: int) -> int:
    """The fewest micro-batches (a divisor of ``batch``) whose activations fit ``budget``
    beside the model states — how a baseline that does not fit runs its batch (gradient
    accumulation); 1 when it fits or when no split fits (then the prediction says so)."""
    if activation + states <= budget:
        return 1
    for m in range(2, batch + 1):
        if batch % m == 0 and activation / m + states <= budget:
            return m
    return 1


def plan_unsupported(plan: Plan, workload: Workload, strategy: str = "") -> str | None:
    """Why the runtime cannot run ``plan``: a tensor-parallel plan over a stage without
    tensor-parallel linears, or the registry's reason for the first stage whose method cannot
    run it over its sharded dim (too few heads, an op kind it has no path for); ``None`` when
    every stage runs. A stage without declared heads is checked with the
    workload's attention heads."""
    methods = {step.method for step in plan.steps} | ({strategy} & set(METHODS))
    if any(get_method(m).tensor_parallel for m in methods):
        for spec in (spec for layer in workload.layers for spec in layer):
            if not spec.tp_pairs and (spec.attention or spec.mlp or spec.scan is not None):
                return f"stage {spec.name!r} has no tensor-parallel linears (no TP_PLAN)"
    stages = {s.name: s for s in workload.period}
    for step in plan.steps:
        stage, method = stages[step.stage], get_method(step.method)
        if step.sharded not in step.mixes or method.name == "gather":
            continue
        heads = stage.heads
        if heads is None and stage.op == "attention":
            heads = workload.heads
        why = method.unsupported(plan.sp_size, heads)
        if why is None and not method.runs(stage.op):
            why = f"{method.name} has no path for the {stage.op} stage {stage.name!r}"
        if why:
            return why
    return None


def _recompute(workload: Workload, recompute: bool) -> Workload:
    if not recompute:
        return workload
    return workload.with_(extra={**workload.extra, "checkpoint": True})


def _square_ulysses(n: int) -> int:
    """The most square ``U × R = n`` grid with Ulysses the larger factor."""
    best = n
    for u in range(1, n + 1):
        if n % u == 0 and u >= n // u:
            best = min(best, u)
    return best


def predict_table(
    workload: Workload,
    strategies: tuple[str, ...] | list[str] = DEFAULT_STRATEGIES,
    sp_sizes: tuple[int, ...] | list[int] = (1, 2, 4, 8),
    cluster: str | Cluster = "h100-nvlink-ib",
    **kwargs,
) -> list[Prediction]:
    """:func:`predict` for every strategy and SP size (SP 1: one row, strategy ``"none"``)."""
    rows = []
    for n in sp_sizes:
        if n == 1:
            p = predict(workload, "dsp", 1, cluster, **kwargs)
            rows.append(Prediction(**{**p.__dict__, "strategy": "none"}))
            continue
        for s in strategies:
            attends = any(spec.attention for layer in workload.layers for spec in layer)
            if s == "ulysses_flat" and (workload.dims == ("l",) or not attends):
                continue
            rows.append(predict(workload, s, n, cluster, **kwargs))
    return rows


def stage_methods(plan: Plan) -> tuple[tuple[str, str], ...]:
    """``(stage, method)`` of every step of ``plan`` that does not run locally: what ``dspzoo
    plan``'s "methods per stage" lines show, and what :func:`merge_same_plans` compares (which
    dim a local stage keeps sharded is not part of it)."""
    return tuple((s.stage, s.method) for s in plan.steps if s.method != "local")


def merge_same_plans(rows: list[Prediction], workload: Workload) -> list[Prediction]:
    """``rows`` with the strategies that run the same method on every stage
    (:func:`stage_methods`) and predict the same figures as one row: the first such
    strategy's, the others in ``same_as`` (e.g. a model of scans only, whose every stage runs
    state passing whatever the attention strategy; or DSP and Ulysses where they differ only
    in which dim a local stage keeps sharded). Strategies with the same methods but other
    figures (Megatron-SP's sharded weights) keep their own rows, and so does the
    prediction-only ``ulysses_flat``; the order of first appearance is kept."""
    out: list[Prediction] = []
    where: dict[tuple, int] = {}
    for p in rows:
        key = None
        if p.sp > 1 and p.strategy != "ulysses_flat":
            plan = make_plan(workload, p.strategy, p.sp)
            figures = tuple(v for k, v in p.__dict__.items() if k not in ("strategy", "same_as"))
            key = (stage_methods(plan), figures)
        if key is not None and key in where:
            first = out[where[key]]
            out[where[key]] = replace(first, same_as=(*first.same_as, *p.strategies))
            continue
        if key is not None:
            where[key] = len(out)
        out.append(p)
    return out


def recommend(rows: list[Prediction]) -> Prediction | None:
    """The paper's rule: the smallest SP size at which a strategy fits memory, and there the
    fastest runnable strategy. ``None`` when nothing fits."""
    runnable = [p for p in rows if p.fits and not p.note]
    if not runnable:
        return None
    smallest = min(p.sp for p in runnable)
    return min((p for p in runnable if p.sp == smallest), key=lambda p: p.step_s)


def _fmt(x: float, unit: str) -> str:
    if unit == "B":
        for u, s in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
            if x >= s:
                return f"{x / s:.2f} {u}"
        return f"{x:.0f} B"
    if unit == "F":
        for u, s in (("PF", 1e15), ("TF", 1e12), ("GF", 1e9), ("MF", 1e6)):
            if x >= s:
                return f"{x / s:.2f} {u}"
        return f"{x:.0f} F"
    if x >= 1:
        return f"{x:.3f} s"
    return f"{x * 1e3:.2f} ms"


TABLE_LEGEND = (
    "columns: FLOPs/rank, bytes/rank = one rank's matmul FLOPs and bytes sent per step "
    "(busiest rank); coll. = collectives and peer transfers it calls;",
    "  act/GPU = activations saved for backward; states/GPU = parameters, gradients and "
    "optimizer states (after --dp/--zero sharding);",
    "  compute / memory / comm = predicted seconds of matmuls, of element-wise work and layout "
    "copies, and of communication incl. latency;",
    "  step = compute + memory + (1 - overlap) * comm; vs dsp = step over DSP's at that SP "
    "size; fits = act + states within 90 % of one GPU's memory.",
)
"""What ``dspzoo plan`` prints under its table: one line per group of columns."""


def format_table(rows: list[Prediction], best: Prediction | None = None) -> str:
    """The table ``dspzoo plan`` prints (``memory``: the memory-bound element-wise work and the
    layout copies around the all-to-alls); a merged row (:func:`merge_same_plans`) names all its
    strategies, comma-separated."""
    width = max([13, *(len(p.label) for p in rows)])
    head = (
        f"{'SP':>3} {'strategy':<{width}} {'FLOPs/rank':>11} {'bytes/rank':>11} {'coll.':>6} "
        f"{'act/GPU':>10} {'states/GPU':>10} {'compute':>10} {'memory':>10} {'comm':>10} "
        f"{'step':>10} "
        f"{'vs dsp':>7} fits"
    )
    lines = [head, "-" * len(head)]
    dsp = {p.sp: p.step_s for p in rows if "dsp" in p.strategies}
    for p in rows:
        ratio = f"{p.step_s / dsp[p.sp]:.2f}x" if p.sp in dsp and dsp[p.sp] else ""
        mark = "yes" if p.fits else "no"
        if p.note:  # no fit to speak of: the strategy does not run this model
            mark = f"- ({p.note})"
        if best is not None and p is best:
            mark += "  <- recommended"
        lines.append(
            f"{p.sp:>3} {p.label:<{width}} {_fmt(p.flops, 'F'):>11} {_fmt(p.bytes, 'B'):>11} "
            f"{p.collectives:>6} {_fmt(p.activation, 'B'):>10} {_fmt(p.states, 'B'):>10} "
            f"{_fmt(p.compute_s, 's'):>10} {_fmt(p.memory_s + p.copy_s, 's'):>10} "
            f"{_fmt(p.comm_s, 's'):>10} {_fmt(p.step_s, 's'):>10} "
            f"{ratio:>7} {mark}"
        )
    if best is not None:
        same = f" (the same plan: {', '.join(best.same_as)})" if best.same_as else ""
        lines.append(
            f"recommendation: SP {best.sp} with {best.strategy}{same} "
            f"(smallest SP size that fits; fastest there: {_fmt(best.step_s, 's')} per step)"
        )
    else:
        lines.append("recommendation: nothing fits; raise the SP sizes or use recompute / ZeRO")
    return "\n".join(lines)

r"""Every sequence-parallel strategy on one model: traced bytes vs formula, memory, agreement.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no scripts/strategy_report.py --model stdit-tiny --frames 16 --latent 16

For the model and workload given (video: ``--frames``/``--latent``, text: ``--seq-len``) and
every strategy in ``--strategies`` (default: every registered one the model can run), this runs
one training step (forward + backward, batch ``--batch``) on the same weights and inputs with
the SP group = all launched processes, under ``trace_comm()`` and ``SavedTensorMeter``, and
prints per strategy:

* forward / backward bytes sent per rank per layer (the traffic of the ``block{i}`` regions,
  divided by the depth), and beside them the method's formula evaluated for the same plan,
  shapes and shards (:func:`block_formula`, exact for uneven shards);
* the ratio of the total to DSP's;
* activation memory saved for backward per rank (exact, MiB) and its ratio to DSP's, and the
  process's peak RSS;
* max |Δ| of the gathered output and of the SP-averaged parameter gradients vs the DSP run.

Every figure is the worst rank's. ``megatron_sp`` runs only when it is registered and the model
declares ``TP_PLAN`` linears (:func:`megatron_support`); it is skipped with the reason otherwise.
``--out`` also writes everything as JSON. ``--no-compare`` skips the agreement check (no DSP
reference needed), e.g. for the longest-context sweep with ``--checkpoint``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dspzoo.core.harness import full_gradients
from dspzoo.core.parallel.layout import shard_sizes
from dspzoo.core.parallel.methods.registry import (
    METHODS,
    AttentionShape,
    CommCount,
    get_method,
    megatron_pair_bytes,
)
from dspzoo.core.parallel.methods.ring import zigzag_lengths

MiB = 2**20
VIDEO_DIMS = ("t", "s")


# -- shapes the formulas need ------------------------------------------------------------------
@dataclass(frozen=True)
class Attn:
    """Head geometry of a model's self-attention."""

    heads: int
    kv_heads: int
    head_dim: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


# -- per-method formulas: the cost model's, summed per phase (bytes sent by rank r) --------------
def _phases(fill: Callable[[CommCount], None]) -> tuple[int, int]:
    out = CommCount()
    fill(out)
    return out.bytes(phase="forward"), out.bytes(phase="backward")


def switch_bytes(
    lead: int, src: list[int], dst_len: int, r: int, n: int, row: int, itemsize: int
) -> int:
    """All-to-all from sharded ``src`` to sharded ``dst``: rank ``r`` sends its ``src[r]`` rows
    × every other rank's ``dst`` rows. ``lead``: product of every other axis (batch, other
    sequence dims), ``row``: channels. Even case: ``(M/N)·(N−1)/N`` elements."""
    dst = shard_sizes(dst_len, n)
    return lead * src[r] * (dst_len - dst[r]) * row * itemsize


def method_bytes(
    method: str, bf: int, seq: list[int], attn: Attn, r: int, itemsize: int, ulysses: int = 1
) -> tuple[int, int]:
    """(forward, backward) bytes of one attention under ``method`` on folded ``[bf, seq_r, H,
    D]`` tensors: the method registry's formula (the cost model's and the tracer's)."""
    shape = AttentionShape(
        tuple(seq), bf, attn.heads, attn.kv_heads, attn.head_dim, itemsize, ulysses
    )
    return _phases(lambda out: get_method(method).attention_bytes(out, shape, r))


def megatron_bytes(lead: int, sizes: list[int], hidden: int, itemsize: int) -> tuple[int, int]:
    """(forward, backward) of one Megatron-SP linear pair: all-gather + reduce-scatter of the
    ``[.., C]`` activation, mirrored in the backward (cost model)."""
    return _phases(lambda out: megatron_pair_bytes(out, sizes, lead * hidden, itemsize))


FORMULA_TEXT = {name: m.formula for name, m in METHODS.items() if m.formula}


# -- the plan, walked block by block -------------------------------------------------------------
def block_stage_names(stage_names: list[str], block: int, period: int) -> list[str]:
    """Stage names of block ``block``: all of them, or for a period of ``period`` tagged
    layers (``name@j``) the ones tagged ``@{block % period}``."""
    if period <= 0:
        return list(stage_names)
    tag = f"@{block % period}"
    return [n for n in stage_names if n.endswith(tag)]


def block_formula(
    plan: Any,
    block: int,
    entering: str,
    stage_names: list[str],
    lengths: dict[str, int],
    batch: int,
    attn: Attn,
    n: int,
    r: int,
    itemsize: int,
    ulysses_size: int = 1,
    tp_pairs: int = 0,
) -> tuple[int, int, str, dict[str, int]]:
    """Formula bytes (forward, backward) rank ``r`` sends in one block, the sharded dim after it,
    and the bytes by kind. Walks the plan: a switch whenever a stage is planned on another dim
    than the current one, the stage's method whenever it runs attention over the sharded dim,
    and ``tp_pairs`` Megatron linear pairs under ``megatron_sp``."""
    del block
    fwd = bwd = 0
    kinds: dict[str, int] = {}
    cur = entering
    names = list(lengths)
    total = math.prod(lengths.values())
    zigzag = getattr(plan, "layout", "contiguous") == "zigzag"
    for name in stage_names:
        step = plan.step_for(name)
        if step.sharded != cur:
            lead = batch * total // (lengths[cur] * lengths[step.sharded])
            src = shard_sizes(lengths[cur], n)
            b = switch_bytes(lead, src, lengths[step.sharded], r, n, attn.hidden, itemsize)
            # the backward's reverse switch sends what the forward received (even: the same)
            dst = shard_sizes(lengths[step.sharded], n)
            back = lead * dst[r] * (lengths[cur] - src[r]) * attn.hidden * itemsize
            fwd, bwd = fwd + b, bwd + back
            kinds["switch"] = kinds.get("switch", 0) + b + back
            cur = step.sharded
        method = step.method
        if get_method(method).tensor_parallel or method == "local" or cur not in step.mixes:
            continue
        rest = math.prod(lengths[d] for d in step.mixes if d != cur)
        bf = batch * math.prod(lengths[d] for d in names if d not in step.mixes)
        split = zigzag_lengths(lengths[cur], n) if zigzag else shard_sizes(lengths[cur], n)
        seq = [s * rest for s in split]
        f, b = method_bytes(method, bf, seq, attn, r, itemsize, ulysses_size)
        fwd, bwd = fwd + f, bwd + b
        kinds[method] = kinds.get(method, 0) + f + b
    if get_method(plan.steps[0].method).tensor_parallel and tp_pairs:
        lead = batch * total // lengths[cur]
        f, b = megatron_bytes(lead, shard_sizes(lengths[cur], n), attn.hidden, itemsize)
        fwd, bwd = fwd + tp_pairs * f, bwd + tp_pairs * b
        kinds["megatron_sp"] = tp_pairs * (f + b)
    return fwd, bwd, cur, kinds


def plan_formula(
    plan: Any,
    stage_names: list[str],
    depth: int,
    period: int,
    lengths: dict[str, int],
    batch: int,
    attn: Attn,
    n: int,
    r: int,
    itemsize: int,
    ulysses_size: int = 1,
    tp_pairs: list[int] | None = None,
    extra: int = 0,
) -> list[tuple[int, int]]:
    """:func:`block_formula` for every block, in order (the sharded dim carries over).

    ``extra`` more blocks after the last one (cycling through ``tp_pairs`` and the period) give
    the steady state of a deep model: the first block of a DSP plan may start on the dim it
    needs (the entry split) and save a switch that every later layer pays.
    """
    cur = plan.entry
    out = []
    for i in range(depth + extra):
        f, b, cur, _ = block_formula(
            plan,
            i,
            cur,
            block_stage_names(stage_names, i, period),
            lengths,
            batch,
            attn,
            n,
            r,
            itemsize,
            ulysses_size,
            0 if tp_pairs is None else tp_pairs[i % depth],
        )
        out.append((f, b))
    return out


# -- models and workloads -------------------------------------------------------------------------
def megatron_support(model: torch.nn.Module) -> str | None:
    """``None`` if ``megatron_sp`` can run ``model``, else the reason it cannot."""
    from dspzoo.core.parallel.strategies import STRATEGIES

    if "megatron_sp" not in STRATEGIES:
        return "megatron_sp is not registered"
    try:
        from dspzoo.core.parallel.methods import megatron  # noqa: F401
    except ImportError as exc:
        return f"dspzoo.core.parallel.methods.megatron does not import ({exc})"
    if not any(getattr(type(m), "TP_PLAN", None) for m in model.modules()):
        return (
            f"{type(model).__name__} declares no TP_PLAN linears (its blocks do not call "
            f"sp.tp_enter/sp.tp_exit)"
        )
    return None


def tp_pairs_per_block(model: torch.nn.Module) -> list[int]:
    """Megatron linear pairs in every block of ``model.blocks``: the modules whose ``TP_PLAN``
    has a row-parallel linear (each closes one gather → column … row → reduce-scatter pair;
    a column-only module such as a separate K/V projection shares its partner's gather)."""

    def closes_pair(module: torch.nn.Module) -> bool:
        plan = getattr(type(module), "TP_PLAN", None) or {}
        return any(entry == "row" for entry in plan.values())

    return [sum(1 for m in block.modules() if closes_pair(m)) for block in model.blocks]


class Workload:
    """A model, its inputs, and the per-rank loss of one step under a :class:`SeqParallel`."""

    def __init__(self, args: argparse.Namespace) -> None:
        from dspzoo.zoo import create_model

        self.args = args
        self.text = args.model.lower().startswith("bytelm")
        if self.text:
            import dspzoo.domains.text  # noqa: F401
        else:
            import dspzoo.domains.video  # noqa: F401
        overrides: dict[str, Any] = {}
        if self.text:
            overrides["checkpoint"] = args.checkpoint
            if args.kv_heads:
                overrides["kv_heads"] = args.kv_heads
        else:
            overrides["cond_dim"] = 0
            overrides["full_attention_every"] = args.full_attention_every
            overrides["max_frames"] = max(args.frames, 16)
        torch.manual_seed(args.seed)
        model = create_model(args.model, **overrides)
        g = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():  # leave the identity start (adaLN-Zero): non-trivial outputs
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * args.perturb)
        self.model = model.train() if self.text else model.eval()
        cfg = model.config
        if self.text:
            self.attn = Attn(cfg.heads, cfg.num_kv_heads, cfg.head_dim)
            self.lengths = {"l": args.seq_len}
            self.stages = list(model.stages)
            self.period = 0
            self.tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)
        else:
            self.attn = Attn(cfg.heads, cfg.heads, cfg.hidden // cfg.heads)
            pt, ph, pw = cfg.patch
            self.lengths = {"t": args.frames // pt, "s": (args.latent // ph) * (args.latent // pw)}
            self.stages = list(model.STAGES)
            self.period = cfg.full_attention_every
            shape = (args.batch, cfg.in_channels, args.frames, args.latent, args.latent)
            self.x = torch.randn(shape, generator=g)
            self.target = torch.randn(shape, generator=g)
            self.t = torch.rand(args.batch, generator=g) * 1000
            self.y = torch.randint(0, max(cfg.num_classes, 1), (args.batch,), generator=g)
        self.depth = cfg.depth

    def describe(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in self.lengths.items())
        a = self.attn
        gqa = f", kv heads {a.kv_heads}" if a.kv_heads != a.heads else ""
        extra = (
            f", checkpoint={self.model.config.checkpoint}"
            if self.text
            else f", full_attention_every={self.period}"
        )
        return (
            f"{self.args.model}: batch {self.args.batch}, dims ({dims}), hidden {a.hidden}, "
            f"heads {a.heads}{gqa}, depth {self.depth}{extra}"
        )

    def step(self, model: torch.nn.Module, sp: Any) -> tuple[torch.Tensor, Any]:
        """This rank's loss and the sharded output (a ``SeqTensor``)."""
        from dspzoo.core import sp_mse
        from dspzoo.domains.text.model import lm_loss

        if self.text:
            out = model(self.tokens[:, :-1], sp, gather_output=False)
            return lm_loss(out, self.tokens[:, 1:], sp), out
        out = model(self.x, self.t, self.y, sp=sp, gather_output=False)
        target = sp.shard_like(model.patchify_target(self.target), out)
        return sp_mse(out.tensor, target, sp.group), out


# -- one strategy -------------------------------------------------------------------------------
def in_block(region: str, i: int) -> bool:
    return region == f"block{i}" or region.startswith(f"block{i}/")


def run_strategy(
    work: Workload, strategy: str, accelerator: Any, world: int, compare: bool
) -> dict[str, Any]:
    """One step of ``strategy``; this rank's measurements."""
    from dspzoo.core import SavedTensorMeter, SeqParallel, build_mesh, trace_comm
    from dspzoo.core.accelerate import default_ulysses_size

    ulysses = default_ulysses_size(world) if strategy == "usp" else None
    mesh = build_mesh(world, accelerator, ulysses_size=ulysses)
    sp = SeqParallel(mesh, strategy)
    model = work.model
    tp_pairs = None
    if strategy == "megatron_sp":
        from dspzoo.core.parallel.methods.megatron import parallelize_megatron

        model = parallelize_megatron(copy.deepcopy(model), sp.group)
        tp_pairs = tp_pairs_per_block(model)
    model.zero_grad(set_to_none=True)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    with trace_comm() as tracer:
        with SavedTensorMeter(model.parameters()) as meter:
            loss, out = work.step(model, sp)
        loss.backward()
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plan = sp.plan(tuple(work.lengths), tuple(work.lengths.values()), tuple(work.stages))
    itemsize = 4 if work.text else work.x.element_size()
    steady_blocks = max(work.period, 1)
    formula = plan_formula(
        plan,
        [s.name for s in work.stages],
        work.depth,
        work.period,
        work.lengths,
        work.args.batch,
        work.attn,
        sp.size,
        sp.rank,
        itemsize,
        1 if ulysses is None else ulysses,
        tp_pairs,
        extra=steady_blocks,
    )
    steady = formula[work.depth :]
    formula = formula[: work.depth]
    traced = [
        (
            sum(
                r.bytes_sent
                for r in tracer.records
                if r.phase == "forward" and in_block(r.region, i)
            ),
            sum(
                r.bytes_sent
                for r in tracer.records
                if r.phase == "backward" and in_block(r.region, i)
            ),
        )
        for i in range(work.depth)
    ]
    ops: dict[str, int] = {}
    for rec in tracer.records:
        key = f"{rec.op}/{rec.phase}"
        ops[key] = ops.get(key, 0) + rec.bytes_sent
    outside = sum(
        r.bytes_sent
        for r in tracer.records
        if not any(in_block(r.region, i) for i in range(work.depth))
    )
    result: dict[str, Any] = {
        "strategy": strategy,
        "plan": str(plan),
        "methods": sorted({s.method for s in plan.steps if s.method != "local"}) or ["local"],
        "switches_per_layer": plan.switches_per_period,
        "traced_per_block": traced,
        "formula_per_block": formula,
        "steady_per_layer": [sum(b[k] for b in steady) / len(steady) for k in (0, 1)],
        "outside_blocks_bytes": outside,
        "bytes_by_op": ops,
        "activation_bytes": meter.bytes,
        "peak_rss_bytes": rss,
        "step_seconds": elapsed,
        "loss": float(loss.detach()),
    }
    if compare:
        with torch.no_grad():
            full = sp.exit(out.with_tensor(out.tensor.detach()))
        result["output"] = full
        result["grads"] = sp_grads(model, sp, mesh, strategy)
    return result


def sp_grads(model: torch.nn.Module, sp: Any, mesh: Any, strategy: str) -> dict[str, torch.Tensor]:
    """Full-sample gradients: the SP mean (gradient contract), or Megatron's sync and gather."""
    return full_gradients(model, sp, mesh, megatron=strategy == "megatron_sp")


# -- report -------------------------------------------------------------------------------------
def worst(values: list[float]) -> float:
    return max(values)


def summarise(per_rank: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """Worst-rank per-layer figures of one strategy from every rank's result."""

    def per_layer(key: str, phase: int) -> float:
        return worst([sum(b[phase] for b in r[key]) / depth for r in per_rank])

    row = {k: per_rank[0][k] for k in ("strategy", "methods", "switches_per_layer", "plan")}
    row["fwd_per_layer"] = per_layer("traced_per_block", 0)
    row["bwd_per_layer"] = per_layer("traced_per_block", 1)
    row["formula_fwd_per_layer"] = per_layer("formula_per_block", 0)
    row["formula_bwd_per_layer"] = per_layer("formula_per_block", 1)
    row["steady_fwd_per_layer"] = worst([r["steady_per_layer"][0] for r in per_rank])
    row["steady_bwd_per_layer"] = worst([r["steady_per_layer"][1] for r in per_rank])
    row["formula_matches"] = all(
        r["traced_per_block"] == [tuple(b) for b in r["formula_per_block"]] for r in per_rank
    )
    row["traced_per_block_rank0"] = per_rank[0]["traced_per_block"]
    row["formula_per_block_rank0"] = [list(b) for b in per_rank[0]["formula_per_block"]]
    row["activation_bytes"] = worst([r["activation_bytes"] for r in per_rank])
    row["peak_rss_bytes"] = worst([r["peak_rss_bytes"] for r in per_rank])
    row["step_seconds"] = worst([r["step_seconds"] for r in per_rank])
    row["outside_blocks_bytes"] = worst([r["outside_blocks_bytes"] for r in per_rank])
    row["bytes_by_op_rank0"] = per_rank[0]["bytes_by_op"]
    row["loss_mean"] = sum(r["loss"] for r in per_rank) / len(per_rank)
    for key in ("max_abs_out_diff", "max_abs_grad_diff"):
        if key in per_rank[0]:
            row[key] = worst([r[key] for r in per_rank])
    return row


def kib(n: float) -> str:
    return f"{n / 1024:.2f}"


def table(rows: list[dict[str, Any]], compare: bool) -> str:
    base = next((r for r in rows if r["strategy"] == "dsp"), None)
    head = (
        f"{'strategy':<12} {'methods':<14} {'fwd KiB':>10} {'formula':>10} {'bwd KiB':>10} "
        f"{'formula':>10} {'total KiB':>10} {'vs dsp':>7} {'=':>2} {'steady':>9} {'act MiB':>9} {'vs dsp':>7} "
        f"{'peakRSS':>8} {'step s':>7}"
    )
    if compare:
        head += f" {'max|Δout|':>10} {'max|Δgrad|':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        total = r["fwd_per_layer"] + r["bwd_per_layer"]
        ratio = (
            f"{total / (base['fwd_per_layer'] + base['bwd_per_layer']):7.2f}"
            if base and base["fwd_per_layer"] + base["bwd_per_layer"]
            else f"{'-':>7}"
        )
        mem_ratio = (
            f"{r['activation_bytes'] / base['activation_bytes']:7.3f}" if base else f"{'-':>7}"
        )
        line = (
            f"{r['strategy']:<12} {'+'.join(r['methods']):<14} {kib(r['fwd_per_layer']):>10} "
            f"{kib(r['formula_fwd_per_layer']):>10} {kib(r['bwd_per_layer']):>10} "
            f"{kib(r['formula_bwd_per_layer']):>10} {kib(total):>10} {ratio} "
            f"{'ok' if r['formula_matches'] else 'NO':>2} "
            f"{kib(r['steady_fwd_per_layer'] + r['steady_bwd_per_layer']):>9} "
            f"{r['activation_bytes'] / MiB:9.2f} {mem_ratio} "
            f"{r['peak_rss_bytes'] / MiB:8.0f} {r['step_seconds']:7.2f}"
        )
        if compare:
            line += (
                f" {r.get('max_abs_out_diff', 0.0):10.2e} {r.get('max_abs_grad_diff', 0.0):10.2e}"
            )
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="stdit-tiny", help="stdit-tiny|stdit-mini|bytelm-tiny|bytelm-small|…"
    )
    parser.add_argument("--strategies", default="all", help="comma-separated, or 'all'")
    parser.add_argument("--frames", type=int, default=16, help="video: latent frames")
    parser.add_argument("--latent", type=int, default=16, help="video: latent H = W")
    parser.add_argument("--full-attention-every", type=int, default=0, help="video (STDiT)")
    parser.add_argument("--seq-len", type=int, default=2048, help="text: bytes per window")
    parser.add_argument("--kv-heads", type=int, default=0, help="text: GQA key/value heads")
    parser.add_argument("--checkpoint", action="store_true", help="text: activation checkpointing")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--perturb", type=float, default=0.02, help="noise added to the init")
    parser.add_argument("--no-compare", action="store_true", help="skip the agreement check")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def reproduce_command(world: int) -> str:
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    return (
        f"OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes {world} --num_machines 1 "
        f"--mixed_precision no --dynamo_backend no scripts/strategy_report.py {argv}"
    )


def select_strategies(requested: str, model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """Strategies to run (dsp first, the reference) and the skipped ones with their reasons."""
    from dspzoo.core.parallel.strategies import STRATEGIES

    names = list(STRATEGIES) if requested == "all" else [s.strip() for s in requested.split(",")]
    skipped: dict[str, str] = {}
    run = []
    for name in names:
        if name not in STRATEGIES:
            skipped[name] = f"not registered (registered: {sorted(STRATEGIES)})"
        elif name == "megatron_sp" and (why := megatron_support(model)):
            skipped[name] = why
        else:
            run.append(name)
    run.sort(key=lambda s: s != "dsp")
    return run, skipped


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from dspzoo.core.accelerate import setup_accelerate

    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    world = world_mesh.world_size
    is_main = world_mesh.rank == 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Workload(args)
    strategies, skipped = select_strategies(args.strategies, work.model)
    compare = not args.no_compare and world > 1
    if compare and "dsp" not in strategies:
        strategies.insert(0, "dsp")
    if is_main:
        print(f"\n{work.describe()}; SP {world} (all {world} processes)")
        for name, why in skipped.items():
            print(f"  skipped {name}: {why}")
        sys.stdout.flush()
    rows, reference = [], None
    for strategy in strategies:
        try:
            mine = run_strategy(work, strategy, accelerator, world, compare)
        except Exception as exc:  # a strategy the model cannot run: report, go on
            if is_main:
                print(f"  {strategy} failed: {type(exc).__name__}: {exc}")
            skipped[strategy] = f"failed: {type(exc).__name__}: {exc}"
            continue
        if compare:
            out, grads = mine.pop("output"), mine.pop("grads")
            if reference is None:
                reference = (out, grads)
            mine["max_abs_out_diff"] = float((out - reference[0]).abs().max())
            # by the reference's names (a tied weight is listed once there, maybe twice here)
            mine["max_abs_grad_diff"] = max(
                float((grads[k] - g).abs().max()) for k, g in reference[1].items() if k in grads
            )
        gathered: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        rows.append(summarise(gathered, work.depth))
        if is_main:
            print(f"  {strategy}: done in {rows[-1]['step_seconds']:.2f} s")
            sys.stdout.flush()
    if is_main:
        print()
        for r in rows:
            print(r["plan"])
        print(
            f"\nper rank, per layer (block regions / depth {work.depth}), worst rank; '=': traced equals the formula on every rank and block; "
            "steady: the formula's fwd+bwd per layer of a deep model (no entry-split saving)"
        )
        print(table(rows, compare))
        methods = sorted({m for r in rows for m in r["methods"]} | {"switch"} - {"local"})
        print(
            "\nformulas: "
            + "\n          ".join(f"{m}: {FORMULA_TEXT[m]}" for m in methods if m in FORMULA_TEXT)
        )
        command = reproduce_command(world)
        print(f"\nreproduce: {command}")
        if args.out:
            payload = {
                "workload": work.describe(),
                "sp": world,
                "args": vars(args),
                "rows": rows,
                "skipped": skipped,
                "command": command,
            }
            with open(args.out, "w") as fh:
                json.dump(payload, fh, indent=1)
        sys.stdout.flush()
    accelerator.wait_for_everyone()
    if dist.is_initialized():  # an explicit teardown: gloo's threads otherwise may abort at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    from dspzoo.core.entry import run_entry_point

    raise SystemExit(run_entry_point(main, "strategy_report.py"))

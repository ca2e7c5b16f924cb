"""The public test harness: a model under every strategy at SP 2, 3, 4 equals one process.

Give it how to build the model, its example inputs and how to call it with a
:class:`~dspzoo.core.SeqParallel`; it spawns gloo workers (:func:`~dspzoo.core.testing.
run_distributed`, one spawn for every SP size) and, for each SP size and strategy, checks

* the forward **output** against the one-process output,
* **every parameter gradient** (SP-group mean, the gradient contract of
  ``docs/gradient_contract.md``; full tensors reassembled under ``megatron_sp``) against the
  one-process gradient,
* when a cost-model :class:`~dspzoo.core.costmodel.Workload` is given, that the **bytes** every
  rank sends — per ``(op, phase)``, count and bytes — equal what the plan predicts
  (:func:`~dspzoo.core.costmodel.comm_bytes` walks the same plan the runtime makes),

and raises one ``AssertionError`` listing every failure by SP size, strategy, rank and
output / parameter / op, with the error found::

    from dspzoo.core.harness import check_model

    def make_model():                 # zero-argument, module level (it is pickled)
        torch.manual_seed(0)
        return MyModel(MyConfig(hidden=16, heads=4))

    def make_inputs():                # example inputs: lengths the SP sizes do not divide
        return {"x": torch.randn(2, 7, 3, 5, 4, generator=torch.Generator().manual_seed(1))}

    def forward(model, inputs, sp):   # replicated output on every rank
        return model(**inputs, sp=sp)

    report = check_model(make_model, make_inputs, forward, workload=my_workload())
    print(report.table())

Errors are relative: ``max|got − want| / max|want|`` over the tensor, compared with ``rtol``
(``atol`` guards tensors that are all but zero). The loss is a fixed random weighting of the
output, so every output element matters.

Verdicts. ``ok``; ``FAIL`` for a wrong answer (or a run that raised: a bug of the model or of
dspzoo, with its message); **not runnable: <reason>** for a strategy this model cannot run at
an SP size, which is not run at all. The reasons are the method registry's
(:meth:`~dspzoo.core.parallel.methods.registry.Method.unsupported`, the same the planner and
the cost model read: e.g. Ulysses with fewer heads than ranks, the head count taken from the
``workload`` or else the smallest ``heads`` attribute of the model's modules) and the
tensor-parallel contract's (:mod:`dspzoo.core.parallel.tp_contract`): ``megatron_sp`` needs
``TP_PLAN`` linears, and at least one head (or feature) per rank. A ``TP_PLAN`` that breaks the
contract (e.g. a head count not called ``heads``) is a ``FAIL`` with the contract's message.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import UsageError
from .parallel.mesh import SPMesh, build_mesh
from .parallel.methods.registry import METHODS
from .parallel.runtime import SeqParallel
from .parallel.strategies import STRATEGIES
from .parallel.tp_contract import (
    TPContractError,
    check_tp_contract,
    declares_tensor_parallelism,
    tp_units,
)
from .parallel.trace import CommTracer, trace_comm
from .testing import run_distributed, sub_mesh

PHASES = ("forward", "backward")

ModelFactory = Callable[[], nn.Module]
InputsFactory = Callable[[], Any]
Forward = Callable[[nn.Module, Any, SeqParallel], torch.Tensor]


def call_with_sp(model: nn.Module, inputs: Any, sp: SeqParallel) -> torch.Tensor:
    """The default ``forward``: ``model(**inputs, sp=sp)`` for a dict, else ``model(*inputs,
    sp=sp)`` for a tuple/list, else ``model(inputs, sp=sp)``."""
    if isinstance(inputs, dict):
        return model(**inputs, sp=sp)
    if isinstance(inputs, tuple | list):
        return model(*inputs, sp=sp)
    return model(inputs, sp=sp)


__all__ = [
    "Check",
    "HarnessReport",
    "call_with_sp",
    "check_model",
    "declares_tensor_parallelism",
    "full_gradients",
    "model_heads",
    "not_runnable",
    "relative_error",
]


def model_heads(model: nn.Module) -> int | None:
    """The smallest integer ``heads`` attribute of the model's modules (``None``: none has one)."""
    counts = [
        h
        for m in model.modules()
        if isinstance(h := getattr(m, "heads", None), int) and not isinstance(h, bool)
    ]
    return min(counts) if counts else None


def not_runnable(
    strategy: str, model: nn.Module, sp_size: int, heads: int | None = None
) -> str | None:
    """Why ``model`` cannot run ``strategy`` at ``sp_size`` ranks (``None``: it can).

    ``heads``: the attention heads of its stages (default :func:`model_heads`). Reasons come
    from the method registry's ``unsupported`` and, for a tensor-parallel method, from the
    model's ``TP_PLAN`` (none declared, or fewer shard units than ranks). A ``TP_PLAN`` that
    breaks the contract is *not* a reason here: running it reports the contract error.
    """
    method = METHODS.get(strategy)
    if method is None:  # a policy over methods (dsp, auto): it plans around what cannot run
        return None
    if not method.tensor_parallel:
        return method.unsupported(sp_size, model_heads(model) if heads is None else heads)
    if not declares_tensor_parallelism(model):
        return (
            f"{type(model).__name__} declares no TP_PLAN linears (tensor parallelism has "
            f"nothing to shard)"
        )
    try:
        smallest = tp_units(model)
    except TPContractError:
        return None
    if smallest is None or smallest.units >= sp_size:
        return None
    if smallest.unit == "heads":
        return f"{method.unsupported(sp_size, smallest.units)} ({smallest.where})"
    return (
        f"{strategy} shards features: {smallest.where} has {smallest.units} per group "
        f"< {sp_size} ranks"
    )


@dataclass(frozen=True)
class Check:
    """One strategy at one SP size on one rank.

    Attributes:
        sp, strategy, rank: where.
        output_error: relative error of the output (``nan`` if the run raised).
        grad_error: the largest relative error over all parameter gradients.
        worst_param: the parameter with that error.
        traced_bytes / plan_bytes: bytes this rank sent in forward + backward, traced and
            predicted (``None`` without a workload).
        failures: what failed, one line each (empty: the check passed).
    """

    sp: int
    strategy: str
    rank: int
    output_error: float
    grad_error: float
    worst_param: str
    traced_bytes: int
    plan_bytes: int | None
    failures: tuple[str, ...] = ()


@dataclass
class HarnessReport:
    """Every :class:`Check` of a :func:`check_model` run (all ranks, all SP sizes)."""

    checks: list[Check] = field(default_factory=list)
    not_runnable: dict[tuple[int, str], str] = field(default_factory=dict)
    """``{(sp, strategy): reason}`` of the strategies the model cannot run (not run)."""

    @property
    def failures(self) -> list[str]:
        return [line for c in self.checks for line in c.failures]

    def summary(self, per_group: int = 4) -> str:
        """The failures, grouped by SP size and strategy: the first ``per_group`` lines of the
        lowest failing rank, and which ranks failed."""
        groups: dict[tuple[int, str], list[Check]] = {}
        for c in self.checks:
            if c.failures:
                groups.setdefault((c.sp, c.strategy), []).append(c)
        lines = []
        for (n, strategy), checks in sorted(groups.items()):
            first = min(checks, key=lambda c: c.rank)
            ranks = ", ".join(str(c.rank) for c in sorted(checks, key=lambda c: c.rank))
            lines.append(f"SP {n}, {strategy}: failed on rank(s) {ranks}")
            lines += [f"  {line}" for line in first.failures[:per_group]]
            if len(first.failures) > per_group:
                more = len(first.failures) - per_group
                lines.append(f"  … and {more} more on rank {first.rank} (report.failures has all)")
        return "\n".join(lines)

    def table(self) -> str:
        """One row per SP size and strategy: worst errors over the ranks, rank 0's bytes, and
        the verdict (``ok``, ``FAIL``, ``not runnable: <reason>``)."""
        rows: dict[tuple[int, str], list[Check]] = {k: [] for k in self.not_runnable}
        for c in self.checks:
            rows.setdefault((c.sp, c.strategy), []).append(c)
        w = max([12, *(len(s) for _, s in rows)])  # the strategy column
        lines = [
            f"{'SP':>3} {'strategy':<{w}} {'output err':>10} {'grad err':>9} "
            f"{'bytes/rank0':>12} {'plan':>12}  result"
        ]
        for (n, strategy), checks in sorted(rows.items()):
            if not checks:
                dash = "-"
                lines.append(
                    f"{n:>3} {strategy:<{w}} {dash:>10} {dash:>9} {dash:>12} {dash:>12}  "
                    f"not runnable: {self.not_runnable[(n, strategy)]}"
                )
                continue
            first = min(checks, key=lambda c: c.rank)
            plan = "-" if first.plan_bytes is None else str(first.plan_bytes)
            ok = "ok" if not any(c.failures for c in checks) else "FAIL"
            lines.append(
                f"{n:>3} {strategy:<{w}} {max(c.output_error for c in checks):>10.1e} "
                f"{max(c.grad_error for c in checks):>9.1e} {first.traced_bytes:>12} "
                f"{plan:>12}  {ok}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class _Case:
    make_model: ModelFactory
    make_inputs: InputsFactory
    forward: Forward
    strategies: tuple[str, ...] | None
    workload: Any
    rtol: float
    atol: float
    seed: int
    timeout: float


def relative_error(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> float:
    """``max|got − want| / max(max|want|, atol)`` in float64 (``inf`` on a shape mismatch)."""
    if got.shape != want.shape:
        return float("inf")
    diff = (got.detach().double() - want.detach().double()).abs().max().item()
    scale = max(want.detach().double().abs().max().item(), atol, 1e-300)
    return diff / scale


def _loss_weight(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)


def _run(case: _Case, sp: SeqParallel, megatron: bool) -> tuple[torch.Tensor, nn.Module]:
    """Build the model (seeded), run forward + backward of the weighted-sum loss."""
    torch.manual_seed(case.seed)
    model = case.make_model()
    if megatron:
        from .parallel.methods.megatron import parallelize_megatron

        check_tp_contract(model)  # a clear message instead of an error deep in the forward
        parallelize_megatron(model, sp.group)
    torch.manual_seed(case.seed)
    out = case.forward(model, case.make_inputs(), sp)
    (out * _loss_weight(out, case.seed)).sum().backward()
    return out.detach(), model


def full_gradients(
    model: nn.Module, sp: SeqParallel, mesh: SPMesh | None, megatron: bool
) -> dict[str, torch.Tensor]:
    """Full-sample gradients after a backward pass, identical on every rank of the SP group:
    the SP-group mean of the local gradients (the gradient contract), or under ``megatron_sp``
    (``megatron=True``) the full tensors reassembled after Megatron's gradient sync."""
    if megatron:
        from .parallel.methods.megatron import gather_full, megatron_grad_sync

        megatron_grad_sync(model, mesh)
        return gather_full(model, sp.group, grads=True)
    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if sp.size > 1:
            dist.all_reduce(g, group=sp.group)
        out[name] = g / sp.size
    return out


def _traced(tracer: CommTracer) -> dict[tuple[str, str], tuple[int, int]]:
    ops = {r.op for r in tracer.records}
    return {
        (op, ph): (tracer.count(op, ph), tracer.total_bytes(op, ph)) for op in ops for ph in PHASES
    }


def _byte_failures(
    where: str, traced: dict, case: _Case, strategy: str, mesh: SPMesh
) -> tuple[int, list[str]]:
    """Compare the tracer with :func:`~dspzoo.core.costmodel.comm_bytes` for this rank."""
    from .costmodel import comm_bytes

    want = comm_bytes(
        case.workload,
        strategy,
        mesh.sp_size,
        mesh.sp_rank,
        ulysses_size=mesh.ulysses_size if strategy == "usp" else 1,
    )
    keys = set(traced) | {k for k, v in want.items() if v != [0, 0]}
    failures = []
    for op, phase in sorted(keys):
        got = tuple(traced.get((op, phase), (0, 0)))
        plan = tuple(want[(op, phase)])
        if got != plan:
            failures.append(
                f"{where}: {op} {phase}: traced {got[0]} collective(s), {got[1]} bytes; "
                f"the plan says {plan[0]}, {plan[1]} bytes"
            )
    return want.bytes(), failures


def _sub_meshes(sizes: Sequence[int]) -> dict[int, SPMesh | None]:
    """An SP group over the first ``n`` ranks for every ``n`` in ``sizes`` (collective)."""
    world = dist.get_world_size()
    return {n: build_mesh(n) if n == world else sub_mesh(n) for n in sizes}


def _worker(
    rank: int, world: int, case: _Case, sizes: tuple[int, ...]
) -> tuple[list[Check], dict[tuple[int, str], str]]:
    torch.manual_seed(case.seed)
    ref_out, ref_model = _run(case, SeqParallel(), megatron=False)
    ref_grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad
        for n, p in ref_model.named_parameters()
    }
    meshes = _sub_meshes(sizes)
    # ranks outside a smaller SP group wait here, not in the next group's first collective
    # (whose timeout is the short one of the process group)
    waiting = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=case.timeout))
    usp_mesh = build_mesh(world, ulysses_size=2) if world % 2 == 0 and world >= 4 else None
    heads = getattr(case.workload, "heads", None)
    strategies = case.strategies or tuple(STRATEGIES)
    checks, skipped = [], {}
    for n in sizes:
        mesh = meshes[n]
        for strategy in strategies:
            why = not_runnable(strategy, ref_model, n, heads)
            if why is not None:  # the same on every rank: nobody enters its collectives
                skipped[(n, strategy)] = why
                continue
            if mesh is None:
                continue
            megatron = METHODS[strategy].tensor_parallel if strategy in METHODS else False
            use = usp_mesh if strategy == "usp" and n == world and usp_mesh else mesh
            checks.append(_check_one(case, use, strategy, megatron, ref_out, ref_grads))
        dist.barrier(group=waiting)
    return checks, skipped


def _check_one(
    case: _Case,
    mesh: SPMesh,
    strategy: str,
    megatron: bool,
    ref_out: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
) -> Check:
    n, r = mesh.sp_size, mesh.sp_rank
    where = f"SP {n}, {strategy}" + (
        f" (ulysses {mesh.ulysses_size} × ring {mesh.ring_size})" if strategy == "usp" else ""
    )
    where = f"{where}, rank {r}"
    sp = SeqParallel(mesh, strategy)
    try:
        with trace_comm() as tracer:
            out, model = _run(case, sp, megatron)
        grads = full_gradients(model, sp, mesh, megatron)
    except Exception as exc:  # a broken model: report it with the others
        return Check(
            n,
            strategy,
            r,
            float("nan"),
            float("nan"),
            "",
            0,
            None,
            (f"{where}: raised {type(exc).__name__}: {exc}",),
        )
    failures = []
    out_err = relative_error(out, ref_out, case.atol)
    if not out_err <= case.rtol:
        failures.append(
            f"{where}: output {tuple(out.shape)} differs from one process: relative error "
            f"{out_err:.2e} > rtol {case.rtol:.0e}"
        )
    grad_err, worst = 0.0, ""
    for name, want in ref_grads.items():
        got = grads.get(name)
        err = float("inf") if got is None else relative_error(got, want, case.atol)
        if not err <= grad_err:
            grad_err, worst = err, name
        if not err <= case.rtol:
            failures.append(
                f"{where}: gradient of {name} differs from one process: relative error "
                f"{err:.2e} > rtol {case.rtol:.0e}"
            )
    plan_bytes = None
    if case.workload is not None:
        plan_bytes, byte_failures = _byte_failures(where, _traced(tracer), case, strategy, mesh)
        failures += byte_failures
    return Check(
        n, strategy, r, out_err, grad_err, worst, tracer.total_bytes(), plan_bytes, tuple(failures)
    )


def check_model(
    make_model: ModelFactory,
    make_inputs: InputsFactory,
    forward: Forward = call_with_sp,
    *,
    strategies: Sequence[str] | None = None,
    sp_sizes: Sequence[int] = (2, 3, 4),
    workload: Any = None,
    rtol: float = 1e-5,
    atol: float = 1e-12,
    seed: int = 0,
    timeout: float = 240,
    raise_on_failure: bool = True,
) -> HarnessReport:
    """Check ``make_model()`` under every strategy at every SP size against one process.

    Args:
        make_model: zero-argument, picklable (module-level) callable returning the model; it is
            called after ``torch.manual_seed(seed)``, so every rank builds the same weights.
        make_inputs: zero-argument callable returning the example inputs (same on every call).
        forward: ``forward(model, inputs, sp) -> Tensor``, the replicated output (default
            :func:`call_with_sp`).
        strategies: names from :data:`~dspzoo.core.parallel.strategies.STRATEGIES` (default:
            all); those the model cannot run at an SP size are reported in
            ``report.not_runnable`` with the reason (``megatron_sp`` without ``TP_PLAN``, Ulysses
            with fewer heads than ranks, ...), not run and not failed.
        sp_sizes: SP sizes to check; one spawn of ``max(sp_sizes)`` gloo processes, the
            smaller sizes on SP groups of its first ranks (USP at the largest even size ≥ 4
            runs Ulysses 2 × Ring).
        workload: a cost-model :class:`~dspzoo.core.costmodel.Workload` describing the model
            at these inputs; when given, traced bytes must equal the plan's on every rank.
        rtol, atol: relative tolerance (fp32: ``1e-5``) and the floor of the error's scale.
        raise_on_failure: raise ``AssertionError`` listing every failure (else just return).

    Returns:
        the :class:`HarnessReport` (every rank's checks).
    """
    sizes = tuple(sorted(set(sp_sizes)))
    if not sizes or sizes[0] < 2:
        raise UsageError(f"sp_sizes must be SP sizes >= 2, got {tuple(sp_sizes)}")
    known = (*STRATEGIES, "auto")
    unknown = [s for s in strategies or () if s not in known]
    if unknown:
        raise UsageError(f"unknown strategies {unknown}; available: {sorted(known)}")
    case = _Case(
        make_model,
        make_inputs,
        forward,
        None if strategies is None else tuple(strategies),
        workload,
        rtol,
        atol,
        seed,
        timeout,
    )
    results = run_distributed(_worker, sizes[-1], case, sizes, timeout=timeout)
    report = HarnessReport(
        [c for checks, _ in results for c in checks],
        {k: why for _, skipped in results for k, why in skipped.items()},
    )
    if raise_on_failure and report.failures:
        raise AssertionError(
            f"{len(report.failures)} failure(s) against one process:\n"
            f"{report.summary()}\n\n{report.table()}"
        )
    return report

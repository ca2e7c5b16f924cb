"""The benchmark: every applicable strategy on the same model, weights and inputs, interleaved.

Runs inside every process of an ``accelerate launch`` (:func:`main`). The strategies come from
:data:`dspzoo.core.parallel.strategies.STRATEGIES` (those the model cannot run are reported with the
registry's reason); they share one mesh per SP layout (:class:`~.meshes.MeshCache`). Per
strategy: one warm-up step under the tracer and the activation meter (bytes sent per rank by
op and phase beside the cost model's ``comm_bytes``, which walks the plan the runtime makes;
activation memory; the output and every gradient against one process), then ``reps`` timed
forward + backward steps. Repetitions are interleaved: repetition ``i`` runs every strategy
once, in an order rotated by ``i``, so the drift of a shared machine spreads over all of them;
ratios to DSP are taken per repetition (paired) and reported with their IQR.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import resource
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist

from ..costmodel.probe import AttentionShape, Rates, probe_group
from ..device_memory import CudaPeak
from ..entry import UsageError
from ..parallel.methods.registry import METHODS
from ..parallel.strategies import STRATEGIES
from .auto_choice import AUTO, auto_choice, needs_own_row
from .case import (
    PEER,
    Case,
    build_case,
    model_argument,
    select_strategies,
    strategies_argument,
)
from .check import Reference, compare, one_process_reference
from .meshes import MeshCache, ulysses_size_for
from .precision import (
    PRECISIONS,
    Precision,
    fp32_equivalent,
    refuse_unsupported,
    scaled_backward,
    sharded_loss_scale,
)
from .stats import paired_ratios, spread

MODES = ("sp", "weak", "strong", "end-to-end")
# ops the cost model's comm_bytes counts (the loss's all-reduce is outside it)
MODEL_OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p")
TRAIN_LR = 1e-4  # end-to-end mode: AdamW's learning rate
__all__ = [
    "MODES",
    "PEER",
    "STRATEGIES",
    "Case",
    "Runner",
    "build_parser",
    "main",
    "parse_args",
    "run",
]


# -- one strategy's runner ------------------------------------------------------------------------
class Runner:
    """A strategy with its own model copy and ``SeqParallel`` on the run's shared mesh of its
    layout; one traced step (bytes, memory, agreement) and timed steps.

    ``train_step`` (end-to-end mode): the timed steps are whole optimisation steps as training
    takes them — the Trainer's :class:`~dspzoo.core.train.OptimisationStep` with the strategy's
    gradient synchronisation (:class:`~dspzoo.core.train.GradientSync`: DDP over dp × sp on its
    own communicator, which also reduces over the SP group, or megatron_sp's tensor-parallel
    path, which divides the sharded gradients) and AdamW — instead of a forward and backward
    with a DP gradient average. The traced step then runs without the synchronisation, so the
    agreement check sees this rank's own gradients.
    """

    def __init__(
        self, name: str, case: Case, sp_size: int, meshes: MeshCache, train_step: bool = False
    ) -> None:
        from ..parallel.runtime import SeqParallel

        self.name = name
        self.case = case
        self.ulysses = ulysses_size_for(name, sp_size)
        self.mesh = meshes.for_strategy(name, sp_size)
        model = copy.deepcopy(case.model)
        if name == PEER:
            from .peer import DeepSpeedUlysses

            self.sp: Any = DeepSpeedUlysses(self.mesh)
        else:
            self.sp = SeqParallel(self.mesh, case.strategy(name))
        self.tensor_parallel = name in METHODS and METHODS[name].tensor_parallel
        self.optimisation_step: Any = None
        if train_step and name != PEER:
            from ..train import GradientSync, OptimisationStep

            sync = GradientSync(meshes.accelerator, self.mesh, self.sp)
            model = sync.shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
            model, optimizer = sync.prepare(model, optimizer)
            self.optimisation_step = OptimisationStep(meshes.accelerator, model, optimizer, sync)
        elif self.tensor_parallel and sp_size > 1:
            from ..parallel.methods.megatron import parallelize_megatron

            model = parallelize_megatron(model, self.sp.group)
        self.model = model  # under DDP in end-to-end mode
        self.raw_model = getattr(model, "module", model)
        self.train_losses: list[float] = []
        self.inputs = case.shard_batch(self.mesh.dp_rank, self.mesh.dp_size)
        self.times: list[float] = []

    def _unsynchronised(self) -> Any:
        """DDP's ``no_sync`` (end-to-end mode's traced step), else nothing."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def _sync_dp(self) -> None:
        """Data-parallel gradient averaging (one flat all-reduce over the DP group)."""
        if self.mesh.dp_size == 1 or self.optimisation_step is not None:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat /= self.mesh.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def traced_step(self, reference: Reference | None) -> dict[str, Any]:
        """The warm-up step: bytes by op and phase, activation memory, loss, its time, and (with
        a ``reference``) the output and gradients against one process."""
        from ..harness import full_gradients
        from ..parallel.trace import SavedTensorMeter, trace_comm

        self.model.zero_grad(set_to_none=True)
        peer = None
        _barrier()
        start = time.perf_counter()
        with CudaPeak() as device_peak, trace_comm() as tracer:
            if self.name == PEER:
                from .peer import count_deepspeed_bytes

                peer_ctx = count_deepspeed_bytes()
                peer = peer_ctx.__enter__()
            try:
                with self._unsynchronised():
                    with SavedTensorMeter(self.model.parameters()) as meter:
                        loss, out = self.case.step(self.model, self.sp, self.inputs)
                    if peer is not None:
                        peer.phase = "backward"
                    scale = 1.0
                    if reference is not None:
                        scale = sharded_loss_scale(reference.loss_scale, self.mesh.sp_size)
                    finite = scaled_backward(loss, self.model.parameters(), scale)
            finally:
                if peer is not None:
                    peer_ctx.__exit__(None, None, None)
        elapsed = _elapsed(start)
        sent = _sent(tracer.records, peer)
        by_op = _by_op(sent)
        total = sum(r.bytes_sent for r in tracer.records) + (peer.total if peer else 0)
        result: dict[str, Any] = {
            "fwd_bytes": _phase_bytes(by_op, "forward"),
            "bwd_bytes": _phase_bytes(by_op, "backward"),
            "bytes_by_op": {k: v for k, v in by_op.items() if v},
            # what the check compares with the formula at 4 bytes per element: 16-bit payloads
            # counted at fp32 (the elements sent); the same as bytes_by_op in an fp32 run
            "bytes_by_op_fp32": {k: v for k, v in _by_op(sent, fp32=True).items() if v},
            "bytes_by_dtype": _by_dtype(sent),
            "all_bytes": total,
            "activation_bytes": meter.bytes,
            "loss": float(loss.detach()),
            "traced_step_s": elapsed,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_device_bytes": device_peak.added_bytes,
        }
        if reference is not None:
            with torch.no_grad():
                full = self.sp.exit(out.with_tensor(out.tensor.detach()))
            grads = full_gradients(self.raw_model, self.sp, self.mesh, self.tensor_parallel)
            agreement = compare(reference, full, grads)
            result["agreement"] = agreement.__dict__ | {
                "ok": agreement.ok,
                "rounding": reference.rounding,
                "loss_scale": scale,
                "reference_loss_scale": reference.loss_scale,
                "finite": finite and reference.finite,
            }
        self._sync_dp()
        return result

    def timed_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        _barrier()
        start = time.perf_counter()
        if self.optimisation_step is not None:
            loss = self.optimisation_step(
                lambda: self.case.step(self.model, self.sp, self.inputs)[0]
            )
        else:
            loss, _ = self.case.step(self.model, self.sp, self.inputs)
            loss.backward()
            self._sync_dp()
        self.times.append(_elapsed(start))
        if self.optimisation_step is not None:  # this rank's loss (its world mean: the batch's)
            self.train_losses.append(float(loss.detach()))

    def formula(self, rank_in_sp: int) -> dict[str, Any]:
        """The cost model for this rank, walking the plan the runtime makes: bytes by op and
        phase (``comm_bytes``, exact) at the run's element size and at 4 bytes per element
        (what the check compares with the traced elements, :func:`fp32_equivalent`),
        activation memory at the run's element size, and the plan itself."""
        from ..costmodel import activation_bytes, comm_bytes, make_plan

        name = "ulysses" if self.name == PEER else self.name
        per_group = self.case.batch // self.mesh.dp_size
        wl32 = self.case.workload(per_group, itemsize=4)
        wl = self.case.workload(per_group)
        n = self.mesh.sp_size
        strategy = self.case.strategy(name)
        plan = None
        if n > 1:  # the plan the runtime makes (a scan method: its embedded strategy's)
            plan = (
                make_plan(wl32, strategy, n)
                if isinstance(strategy, str)
                else strategy.plan(wl32.dims, wl32.lengths, wl32.period, n)
            )

        def by_op(workload: Any) -> Any:
            return comm_bytes(
                workload, plan or name, n, rank_in_sp, ulysses_size=self.ulysses or 1,
                exit_gather=False,
            )  # fmt: skip

        counts = by_op(wl)
        methods = sorted({s.method for s in plan.steps} - {"local"}) if plan else []
        return {
            "fwd": counts.bytes(phase="forward"),
            "bwd": counts.bytes(phase="backward"),
            "bytes_by_op": _nonzero(counts),
            "bytes_by_op_fp32": _nonzero(counts if wl.itemsize == 4 else by_op(wl32)),
            "activation": activation_bytes(wl, plan or name, n, rank_in_sp),
            "plan": str(plan) if plan else "SP 1: no plan",
            "methods": methods or ["local"],
        }


def _nonzero(counts: Any) -> dict[str, int]:
    """``{"op/phase": bytes}`` of a ``comm_bytes`` count, its non-zero entries."""
    return {f"{op}/{ph}": b for (op, ph), (_, b) in counts.items() if b}


def _sent(records: list[Any], peer: Any) -> list[tuple[str, str, int]]:
    """``(op/phase, dtype, bytes)`` of every collective the cost model counts
    (:data:`MODEL_OPS`), DeepSpeed's own all-to-alls (``peer``, counted at its comm layer)
    included."""
    sent = [(f"{r.op}/{r.phase}", r.dtype, r.bytes_sent) for r in records if r.op in MODEL_OPS]
    if peer is not None:
        sent += [(f"all_to_all/{ph}", dtype, n) for (ph, dtype), n in peer.by_dtype.items()]
    return sent


def _by_op(sent: list[tuple[str, str, int]], fp32: bool = False) -> dict[str, int]:
    """Bytes per ``op/phase``; ``fp32``: 16-bit payloads at fp32 size (:func:`fp32_equivalent`)."""
    by_op: dict[str, int] = {}
    for key, dtype, n in sent:
        by_op[key] = by_op.get(key, 0) + (fp32_equivalent(n, dtype) if fp32 else n)
    return by_op


def _by_dtype(sent: list[tuple[str, str, int]]) -> dict[str, int]:
    """Bytes per dtype sent (``float32``, ``bfloat16``, …)."""
    out: dict[str, int] = {}
    for _, dtype, n in sent:
        out[dtype] = out.get(dtype, 0) + n
    return {k: v for k, v in out.items() if v}


def _phase_bytes(by_op: dict[str, int], phase: str) -> int:
    return sum(v for k, v in by_op.items() if k.endswith(f"/{phase}"))


def _barrier() -> None:
    """Every rank here, and this rank's queued device work done (so a timer starts clean)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _elapsed(start: float) -> float:
    """Seconds since ``start`` (``time.perf_counter``), once this rank's device work is done:
    CUDA kernels run asynchronously, so a step's time includes waiting for them."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def device_name(device: torch.device) -> str:
    """What the run computes on, in words: a CUDA GPU's name, else the device type (``cpu``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


# -- modes ---------------------------------------------------------------------------------------
def choose_layout(args: argparse.Namespace, world: int) -> tuple[int, int, str]:
    """``(sp, global batch, note)`` of the mode.

    ``sp``: SP = every process, batch ``--batch``. ``weak``: SP = every process, batch
    ``--batch`` × N (the work per rank stays fixed as N grows). ``strong``: SP = every process,
    batch ``--batch`` (fixed work), plus a one-process baseline for the speed-up.
    ``end-to-end``: global batch ``--batch`` × N over ``sp × dp = N``, with the smallest SP
    whose predicted memory per rank (activations + parameters, gradients, Adam: whole on every
    rank, as under DDP) fits ``--memory-budget-mib`` (the DSP paper's rule); its timed steps
    are the Trainer's optimisation steps (:class:`Runner`).
    """
    if args.mode in ("sp", "strong"):
        return world, args.batch, f"SP {world}, batch {args.batch}"
    if args.mode == "weak":
        return world, args.batch * world, f"SP {world}, batch {args.batch} × {world}"
    from ..costmodel import activation_bytes, model_state_bytes

    batch = args.batch * world
    probe = build_case(args, 1)
    budget = args.memory_budget_mib * 2**20
    tried = []
    for sp in [d for d in range(1, world + 1) if world % d == 0]:
        dp = world // sp
        if batch % dp:
            continue
        wl = probe.workload(batch // dp)
        # DDP, as training: every rank holds whole weights, gradients and Adam moments
        need = activation_bytes(wl, "dsp", sp) + model_state_bytes(
            wl.params, param_itemsize=4, grad_itemsize=4, zero=0
        )
        tried.append(f"SP {sp}: {need / 2**20:.0f} MiB")
        if need <= budget:
            return (
                sp,
                batch,
                f"SP {sp} × DP {dp} (smallest SP that fits; {', '.join(tried)} ≤ budget {args.memory_budget_mib} MiB)",
            )
    return (
        world,
        batch,
        f"nothing fits {args.memory_budget_mib} MiB ({', '.join(tried)}): SP {world}",
    )


def peer_status(args: argparse.Namespace, case: Case, sp: int) -> str | None:
    """``None`` when the DeepSpeed peer runs, else why not (reported, never silent)."""
    from ..costmodel import make_plan
    from .peer import deepspeed_available, deepspeed_cannot_run

    if args.peer == "off":
        return "--peer off"
    if case.mamba:
        return "DeepSpeed-Ulysses is an attention method; a Mamba model's stages are scans"
    if not deepspeed_available():
        if args.peer == "on":
            raise SystemExit("--peer on: deepspeed does not import (pip install '.[peers]')")
        return "deepspeed is not installed (optional: pip install '.[peers]')"
    if sp == 1:
        return "SP 1: no sequence parallelism to compare"
    sharded = make_plan(case.workload(1), "ulysses", sp).entry
    cfg = case.model.config
    kv = getattr(cfg, "num_kv_heads", None) or cfg.heads
    return deepspeed_cannot_run(case.lengths, sharded, cfg.heads, kv, sp)


# -- the run -------------------------------------------------------------------------------------
def baseline_time(case: Case, warmup: int, reps: int) -> list[float]:
    """One process alone (SP 1, the whole batch): the strong-scaling reference (rank 0)."""
    from ..parallel.runtime import SeqParallel

    model, sp, times = copy.deepcopy(case.model), SeqParallel(), []
    for i in range(warmup + reps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss, _ = case.step(model, sp, case.inputs)
        loss.backward()
        if i >= warmup:
            times.append(_elapsed(start))
    return times


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark in this process; rank 0 returns the results, the others ``None``."""
    from ..accelerate import setup_accelerate

    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    world, rank = world_mesh.world_size, world_mesh.rank
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    sp_size, batch, layout = choose_layout(args, world)
    case = build_case(args, batch).to(accelerator.device)
    names, skipped = select_strategies(args.strategies, case, sp_size)
    if args.reps and needs_own_row(case, names, sp_size, world // sp_size):  # none runs auto's
        names.append(AUTO)
    why_not = peer_status(args, case, sp_size)
    if why_not is None:
        from .peer import init_deepspeed

        init_deepspeed()
        names.append(PEER)
    else:
        skipped[PEER] = why_not
    meshes = MeshCache(accelerator, built=(world_mesh,))
    train_step = args.mode == "end-to-end"
    runners = [Runner(n, case, sp_size, meshes, train_step) for n in names]
    main = rank == 0
    reference = None
    if not args.no_check:  # one process on this rank's DP group's samples
        reference = one_process_reference(case, runners[0].inputs)
    timed_rounds = args.warmup - 1 + args.reps if args.reps else 0
    bar = None
    if main and not args.no_progress:
        from ..progress import progress_bar

        bar = progress_bar(total=len(runners) * (1 + timed_rounds), desc="bench", unit="step")
    mine: dict[str, dict[str, Any]] = {}
    for r in runners:  # warm-up 1: traced and metered
        mine[r.name] = r.traced_step(reference)
        if bar:
            bar.set_postfix_str(r.name)
            bar.update()
    del reference
    for i in range(timed_rounds):  # interleaved, order rotated per repetition
        order = runners[i % len(runners) :] + runners[: i % len(runners)]
        for r in order:
            r.timed_step()
            if bar:
                bar.update()
        if i < args.warmup - 1:
            for r in runners:
                r.times.clear()
    if bar:
        bar.close()
    probed = None  # the rates of this run, at its load, on its SP group (SP 1 sends nothing)
    on_cpu = accelerator.device.type == "cpu"
    if args.cluster == "this-cpu" and args.reps and sp_size > 1 and on_cpu:
        shape = attention_shape(case.workload(case.batch // (world // sp_size)), sp_size)
        probed = probe_group(runners[0].mesh.sp_group, threads=threads, attention=shape)
    for r in runners:
        mine[r.name]["times"] = r.times
        mine[r.name]["train_losses"] = r.train_losses
        mine[r.name]["formula"] = r.formula(r.mesh.sp_rank)
    base_times = None
    if args.mode == "strong" and args.reps:
        if main:
            base_times = baseline_time(case, 1, args.reps)
        _barrier()
    gathered: list[Any] = [mine]
    if dist.is_initialized() and world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    result = None
    if main:
        result = summarise(
            args, case, gathered, names, skipped, sp_size, world, layout, probed,
            device=device_name(accelerator.device),
        )  # fmt: skip
        result["threads_per_process"] = threads
        result["meshes"] = len(meshes)
        if base_times:
            result["baseline_sp1"] = spread(base_times)
    accelerator.wait_for_everyone()
    return result


def summarise(
    args: argparse.Namespace,
    case: Case,
    gathered: list[dict[str, dict[str, Any]]],
    names: list[str],
    skipped: dict[str, str],
    sp: int,
    world: int,
    layout: str,
    probed: Rates | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Worst-rank figures per strategy; step time of a repetition = its slowest rank's.

    ``probed``: this run's rates (:func:`~dspzoo.core.costmodel.probe.probe_group`), the
    ``this-cpu`` cluster of the prediction. ``device``: what the run computed on
    (:func:`device_name`); on a GPU the ``this-cpu`` prediction is skipped, with the reason."""
    dp = world // sp
    rows = []
    for name in names:
        per = [g[name] for g in gathered]
        steps = [max(t) for t in zip(*(p["times"] for p in per))]
        traced = [p["fwd_bytes"] + p["bwd_bytes"] for p in per]
        formula = [p["formula"]["fwd"] + p["formula"]["bwd"] for p in per]
        row = {
            "strategy": name,
            "methods": per[0]["formula"]["methods"],
            "plan": per[0]["formula"]["plan"],
            "times": steps,
            "time": spread(steps) if steps else None,
            "tokens_per_s": case.tokens / statistics.median(steps) if steps else None,
            "traced_step_s": max(p["traced_step_s"] for p in per),
            "bytes_fwd": max(p["fwd_bytes"] for p in per),
            "bytes_bwd": max(p["bwd_bytes"] for p in per),
            "bytes": max(traced),
            "bytes_all_ops": max(p["all_bytes"] for p in per),
            "formula_bytes_fwd": max(p["formula"]["fwd"] for p in per),
            "formula_bytes_bwd": max(p["formula"]["bwd"] for p in per),
            "formula_bytes": max(formula),
            # every rank, every (op, phase): the traced elements (16-bit payloads at fp32 size,
            # so in an fp32 run the traced bytes) == the cost model's walk of the plan at fp32
            "formula_exact": all(
                p["bytes_by_op_fp32"] == p["formula"]["bytes_by_op_fp32"] for p in per
            ),
            # and byte for byte at the run's element sizes (under autocast: each collective
            # priced in the dtype it sends; the same as formula_exact in an fp32 run)
            "formula_bytes_exact": all(
                p["bytes_by_op"] == p["formula"]["bytes_by_op"] for p in per
            ),
            "bytes_by_op": [p["bytes_by_op"] for p in per],
            "formula_bytes_by_op": [p["formula"]["bytes_by_op"] for p in per],
            "bytes_by_dtype": [p["bytes_by_dtype"] for p in per],
            "activation_bytes": max(p["activation_bytes"] for p in per),
            "formula_activation_bytes": max(p["formula"]["activation"] for p in per),
            "peak_rss_bytes": max(p["peak_rss_bytes"] for p in per),
            "peak_device_bytes": max((p.get("peak_device_bytes") or 0) for p in per) or None,
            "loss": statistics.mean(p["loss"] for p in per),
        }
        if per[0]["train_losses"]:  # end-to-end: the global batch's loss of every timed step
            row["train_losses"] = [
                statistics.mean(s) for s in zip(*(p["train_losses"] for p in per))
            ]
        if "agreement" in per[0]:
            agree = [p["agreement"] for p in per]
            row["output_error"] = max(a["output_error"] for a in agree)
            row["grad_error"] = max(a["grad_error"] for a in agree)
            row["worst_param"] = max(agree, key=lambda a: a["grad_error"])["worst_param"]
            row["missing_grads"] = sorted({m for a in agree for m in a["missing"]})
            # each rank against its own tolerance (under autocast: its reference's rounding)
            row["agrees"] = all(a["ok"] for a in agree)
            row["rtol"] = max(a["rtol"] for a in agree)
            row["reference_rounding"] = max(a["rounding"] for a in agree)
            row["loss_scale"] = min(a.get("loss_scale", 1.0) for a in agree)
            row["reference_loss_scale"] = min(a.get("reference_loss_scale", 1.0) for a in agree)
            row["finite_grads"] = all(a.get("finite", True) for a in agree)
        rows.append(row)
    dsp = rows[0]
    for row in rows:
        row["vs_dsp"] = {
            "bytes": row["bytes"] / dsp["bytes"] if dsp["bytes"] else float("nan"),
            "activation": row["activation_bytes"] / dsp["activation_bytes"],
        }
        if row["times"]:
            row["vs_dsp"]["time"] = row["time"]["median"] / dsp["time"]["median"]
            row["vs_dsp"]["tokens_per_s"] = row["tokens_per_s"] / dsp["tokens_per_s"]
            row["vs_dsp"]["time_paired"] = spread(paired_ratios(row["times"], dsp["times"]))
    result = {
        "case": case.describe(),
        "model": case.name,
        "mode": args.mode,
        "layout": layout,
        "world": world,
        "sp": sp,
        "dp": dp,
        "batch": case.batch,
        "tokens_per_step": case.tokens,
        "warmup": args.warmup,
        "reps": args.reps,
        "checked": not args.no_check,
        "rtol": max((r["rtol"] for r in rows if "rtol" in r), default=case.precision.rtol),
        "precision": case.precision.name,
        "precision_label": case.precision.label,
        "itemsize": case.precision.itemsize,
        "stream_itemsize": case.precision.stream_itemsize or case.precision.itemsize,
        "rows": rows,
        "skipped": skipped,
        "args": vars(args),
        "command": reproduce_command(args, world),
        "device": device,
    }
    if probed is not None:
        result["probe"] = asdict(probed)
    if args.cluster == "this-cpu" and device != "cpu":  # its rates are the host CPU's
        result["prediction_skipped"] = (
            "no prediction: the run is on a GPU and the `this-cpu` cluster prices this host's "
            "CPU; name a preset with --cluster (e.g. h100-nvlink-ib)"
        )
    elif args.cluster != "none" and args.reps:
        add_prediction(result, case, args.cluster)
    choice = auto_choice(result, case)
    if choice is not None:
        result["auto"] = choice
    return result


#: the longest sequence the attention probe runs: beyond it the kernel's rate has flattened
#: (55–66 GFLOP/s from 256 to 2048 tokens here), and a 64K-token call would take the probe
#: tens of seconds
PROBE_MAX_LENGTH = 4096


def attention_shape(workload: Any, sp_size: int) -> AttentionShape | None:
    """One rank's call of the workload's heaviest self-attention stage, for the probe: its
    sequences shared over the SP group as DSP shares them, or, with fewer sequences than
    ranks (one text sequence), its heads as Ulysses shares them; at most
    :data:`PROBE_MAX_LENGTH` tokens. ``None`` without self-attention."""
    from ..costmodel.formulas import stage_flops

    stages = [s for layer in workload.layers for s in layer if s.attention]
    if not stages:
        return None
    heaviest = max(stages, key=lambda s: stage_flops(workload, s).attention)
    lengths = dict(zip(workload.dims, workload.lengths))
    length = math.prod(lengths[d] for d in heaviest.attention)
    sequences = workload.batch * math.prod(workload.lengths) // max(length, 1)
    if sequences >= sp_size:
        batch, heads = sequences // sp_size, workload.heads
    else:
        batch, heads = max(1, sequences), max(1, workload.heads // sp_size)
    return AttentionShape(
        batch=batch,
        heads=heads,
        length=min(length, PROBE_MAX_LENGTH),
        head_dim=workload.head_dim,
        causal=workload.causal,
    )


def add_prediction(result: dict[str, Any], case: Case, cluster: str) -> None:
    """The cost model's step time on ``cluster`` beside the measured median, and its error.

    ``this-cpu`` is the rates this run probed (``result["probe"]``, measured after the timed
    repetitions on the SP group with the run's threads; also cached as the machine's
    ``this-cpu``), so the prediction sees the load the steps saw. At SP 1 nothing is probed
    (no collective to time) and the cached ``this-cpu`` is used.
    """
    from ..costmodel import get_cluster, predict
    from ..costmodel.cluster import cache_this_cpu, this_cpu

    if cluster == "this-cpu" and "probe" in result:
        rates = Rates(**result["probe"])
        cl = this_cpu(rates)
        cache_this_cpu(cl, rates)  # the machine's figures from now on
    else:
        cl = get_cluster(cluster)
    sp, dp = result["sp"], result["dp"]
    wl = case.workload(case.batch // dp)
    # plain: without the memory terms, the attention rate and the switch's own rates (the
    # all-to-all's α-β prices switches too), on the same probed rates otherwise
    errors, plain_errors = [], []
    plain = replace(cl, hbm_bw=0.0, attention_tflops=0.0, switch_bw=0.0, switch_lat=0.0)
    for row in result["rows"]:
        name = "ulysses" if row["strategy"] == PEER else row["strategy"]
        try:
            p = predict(wl, name, sp, cl, dp=dp)
            p_plain = predict(wl, name, sp, plain, dp=dp)
        except Exception as exc:  # a strategy the model cannot describe: say so
            row["prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        measured = row["time"]["median"]
        err = (p.step_s - measured) / measured
        row["prediction"] = {
            "step_s": p.step_s,
            "compute_s": p.compute_s,
            "comm_s": p.comm_s,
            "memory_s": p.memory_s + p.copy_s,
            "error": err,
            "error_without_probed_terms": (p_plain.step_s - measured) / measured,
        }
        errors.append(abs(err))
        plain_errors.append(abs(row["prediction"]["error_without_probed_terms"]))
    result["cluster"] = {k: v for k, v in cl.__dict__.items()}
    if errors:
        result["prediction_error"] = {
            "median_abs": statistics.median(errors),
            "max_abs": max(errors),
        }
        if cl.name == "this-cpu":  # terms probed on this machine (not a preset's data sheet)
            result["prediction_error"]["median_abs_without_probed_terms"] = statistics.median(
                plain_errors
            )
            result["prediction_error"]["max_abs_without_probed_terms"] = max(plain_errors)


def reproduce_command(args: argparse.Namespace, world: int) -> str:
    """The command that reruns this benchmark from the folder it ran in: this process's
    flags, with ``--mixed-precision`` whenever the run was not fp32, and the script's absolute
    path (as ``dspzoo bench`` prints it: a path relative to that folder would need the
    reader to know it). Accelerate's own ``--mixed_precision`` stays ``no``: the benchmark
    autocasts its steps itself."""
    from .launch import SCRIPT

    words = sys.argv[1:]
    precision = getattr(args, "mixed_precision", "no")
    given = any(w == "--mixed-precision" or w.startswith("--mixed-precision=") for w in words)
    if precision != "no" and not given:
        words = [*words, "--mixed-precision", precision]
    argv = " ".join(shlex.quote(a) for a in words)
    ran = os.path.abspath(sys.argv[0]) if sys.argv[0].endswith(".py") else str(SCRIPT)
    script = shlex.quote(ran)
    if world == 1:  # one process needs no launcher (and Accelerate refuses --multi_gpu for it)
        return f"python {script} {argv}".strip()
    return (
        f"accelerate launch --multi_gpu --num_processes {world} --num_machines 1 "
        f"--mixed_precision no --dynamo_backend no {script} {argv}"
    ).strip()


def build_parser(prog: str = "benchmark.py") -> argparse.ArgumentParser:
    """The benchmark's flags; a bad one is one line, printed once per launch
    (:class:`~dspzoo.core.argparser.CommandParser`), status 2. ``--model`` and
    ``--strategies`` are checked here (:func:`~.case.model_argument`,
    :func:`~.case.strategies_argument`): every rank parses the same argv, so a model the
    benchmark cannot build or a misspelt strategy is refused alike on every rank, before
    anything is built (and by ``dspzoo bench`` before it launches)."""
    from ..argparser import CommandParser

    p = CommandParser(
        prog=prog,
        description="Every sequence-parallel strategy on the same model, weights and inputs "
        "(see docs/benchmark.md).",
    )
    p.add_argument(
        "--model",
        type=model_argument,
        default="stdit-mini",
        help="video DiTs stdit-*, latte-*; byte LMs bytelm-*; Mamba models: LMs mambalm-*, "
        "mamba2lm-*, video videomamba-* (e.g. stdit-tiny, bytelm-small, mamba2lm-tiny, "
        "videomamba-tiny; other families: dspzoo plan)",
    )
    p.add_argument("--mode", choices=MODES, default="sp")
    p.add_argument("--frames", type=int, default=16,
                   help="video (stdit, latte, videomamba): latent frames T")  # fmt: skip
    p.add_argument("--latent", type=int, default=32,
                   help="video: latent H = W (S = (H/2)²)")  # fmt: skip
    p.add_argument("--full-attention-every", type=int, default=0,
                   help="video (STDiT): every k-th layer attends over t·s jointly (0: never)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=1024,
                   help="text (bytelm, mambalm, mamba2lm): bytes per sample")  # fmt: skip
    p.add_argument("--kv-heads", type=int, default=0, help="text: GQA key/value heads (0: heads)")
    p.add_argument("--checkpoint", action="store_true",
                   help="text (bytelm, Mamba LMs): activation checkpointing")  # fmt: skip
    p.add_argument("--perturb", type=float, default=0.02, help="noise added to the initial weights")
    p.add_argument("--batch", type=int, default=1, help="samples per step (per N in weak/e2e)")
    p.add_argument(
        "--strategies",
        type=strategies_argument,
        default="all",
        help="comma-separated, or 'all': every registered strategy (a Mamba model: its scan "
        "methods dsp, state_passing, head_a2a); one the model cannot run is listed under "
        "'not run' with the reason",
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (the first is traced)")
    p.add_argument("--reps", type=int, default=5,
                   help="timed steps per strategy (0: the traced step only — bytes, memory, check)")  # fmt: skip
    p.add_argument("--no-check", action="store_true",
                   help="skip the check against one process (e.g. for the longest contexts)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores/N)")
    p.add_argument("--memory-budget-mib", type=float, default=256, help="end-to-end: per rank")
    p.add_argument("--peer", choices=("auto", "on", "off"), default="auto",
                   help="DeepSpeed-Ulysses peer row (auto: when deepspeed imports)")  # fmt: skip
    p.add_argument(
        "--cluster",
        default="this-cpu",
        help="cost-model cluster whose predicted step time is printed beside the measured one "
        "(default: this-cpu, probed on the run's SP group after its timed repetitions; a "
        "preset such as h100-nvlink-ib; 'none' skips the comparison)",
    )
    p.add_argument("--mixed-precision", choices=PRECISIONS, default="no",
                   help="run every step's forward and loss under torch.autocast in this dtype, "
                   "parameters fp32 (default no: fp32 steps; fp16 needs a CUDA GPU)")  # fmt: skip
    p.add_argument("--out", default="outputs/bench", help="folder for results.json/.md/.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """The benchmark's flags, checked: what :func:`main` runs on every rank, and what
    ``dspzoo bench`` checks before it launches (so a bad flag never launches anything).
    Errors are ``parser``'s (default :func:`build_parser`): one line, status 2."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.reps < 0:
        parser.error("--warmup must be ≥ 1 and --reps ≥ 0 (0: the traced step only)")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``scripts/benchmark.py`` (every launched process calls it)."""
    from .report import write_report

    parser = build_parser()
    args = parse_args(argv, parser)
    # every rank, before any process group: the same answer everywhere (a CPU run has no
    # CUDA), said once per launch by the parser
    try:
        refuse_unsupported(Precision(args.mixed_precision), torch.cuda.is_available())
    except UsageError as exc:
        parser.error(str(exc))
    result = run(args)
    if result is not None:
        write_report(result, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()

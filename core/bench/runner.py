"""The benchmark: every applicable strategy on the same model, weights and inputs, interleaved.

Runs inside every process of an ``accelerate launch`` (:func:`main`). Per strategy: one
warm-up step under the tracer and the activation meter (bytes sent per rank by phase,
activation memory per rank, the gathered output for the agreement check), then ``reps`` timed
forward + backward steps. Repetitions are interleaved: repetition ``i`` runs every strategy
once, in an order rotated by ``i``, so the drift of a shared machine spreads over all of them.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

STRATEGIES = ("dsp", "ulysses", "ring", "ring_zigzag", "lss", "usp", "megatron_sp")
PEER = "deepspeed_ulysses"
MODES = ("sp", "weak", "strong", "end-to-end")
# ops the cost model's comm_bytes counts (the loss's all-reduce is outside it)
MODEL_OPS = ("all_to_all", "all_gather", "reduce_scatter", "p2p", "validate")


# -- the case: model, inputs, loss ----------------------------------------------------------------
@dataclass
class Case:
    """One model with its weights and one global batch of inputs, the same on every rank."""

    name: str
    text: bool
    model: torch.nn.Module
    lengths: dict[str, int]
    batch: int
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    frames: int = 0
    latent: int = 0

    @property
    def tokens(self) -> int:
        """Tokens of the global batch (one step)."""
        return self.batch * math.prod(self.lengths.values())

    def describe(self) -> str:
        dims = " × ".join(f"{d}={n}" for d, n in self.lengths.items())
        cfg = self.model.config
        return (
            f"{self.name} (hidden {cfg.hidden}, heads {cfg.heads}, depth {cfg.depth}): "
            f"global batch {self.batch}, {dims} = {self.tokens} tokens per step"
        )

    def workload(self, batch: int) -> Any:
        """The cost model's description of ``batch`` samples of this case."""
        from dspzoo.zoo.workloads import workload_for

        if self.text:
            return workload_for(
                self.name, batch=batch, seq_len=self.lengths["l"], overrides=self.overrides
            )
        return workload_for(
            self.name,
            batch=batch,
            frames=self.frames,
            spatial=self.latent,
            overrides=self.overrides,
        )

    def shard_batch(self, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
        """The samples of data-parallel group ``dp_rank``."""
        per = self.batch // dp_size
        return {k: v[dp_rank * per : (dp_rank + 1) * per] for k, v in self.inputs.items()}

    def step(self, model: torch.nn.Module, sp: Any, inputs: dict[str, torch.Tensor]):
        """This rank's loss and its output shard (a ``SeqTensor``; no output gather)."""
        from ..loss import sp_mse

        if self.text:
            from dspzoo.domains.text.model import lm_loss

            tokens = inputs["tokens"]
            out = model(tokens[:, :-1], sp, gather_output=False)
            return lm_loss(out, tokens[:, 1:], sp), out
        out = model(inputs["x"], inputs["t"], inputs["y"], sp=sp, gather_output=False)
        raw = getattr(model, "module", model)  # under DDP (end-to-end mode)
        target = sp.shard_like(raw.patchify_target(inputs["target"]), out)
        return sp_mse(out.tensor, target, sp.group), out


def build_case(args: argparse.Namespace, batch: int) -> Case:
    """The model (seeded, perturbed off its identity start) and ``batch`` samples of inputs."""
    from dspzoo.zoo import create_model

    text = args.model.lower().startswith("bytelm")
    if text:
        import dspzoo.domains.text  # noqa: F401
    else:
        import dspzoo.domains.video  # noqa: F401
    overrides: dict[str, Any] = (
        {"max_len": max(args.seq_len, 512)}
        if text
        else {"cond_dim": 0, "max_frames": max(args.frames, 16)}
    )
    torch.manual_seed(args.seed)
    model = create_model(args.model, **overrides)
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():  # adaLN-Zero starts as the identity: perturb for non-trivial outputs
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    cfg = model.config
    if text:
        tokens = torch.randint(0, 256, (batch, args.seq_len + 1), generator=g)
        return Case(args.model, True, model.train(), {"l": args.seq_len}, batch,
                    {"tokens": tokens}, overrides)  # fmt: skip
    pt, ph, pw = cfg.patch
    lengths = {"t": args.frames // pt, "s": (args.latent // ph) * (args.latent // pw)}
    shape = (batch, cfg.in_channels, args.frames, args.latent, args.latent)
    inputs = {
        "x": torch.randn(shape, generator=g),
        "target": torch.randn(shape, generator=g),
        "t": torch.rand(batch, generator=g) * 1000,
        "y": torch.randint(0, max(cfg.num_classes, 1), (batch,), generator=g),
    }
    return Case(args.model, False, model.eval(), lengths, batch, inputs, overrides,
                args.frames, args.latent)  # fmt: skip


# -- one strategy's runner ------------------------------------------------------------------------
class Runner:
    """A strategy with its own model copy and ``SeqParallel``; traced and timed steps.

    ``train_step``: take whole optimisation steps as training does (end-to-end mode) — the
    Trainer's :class:`~dspzoo.core.train.OptimisationStep` with the strategy's gradient
    synchronisation (DDP over dp × sp, or megatron_sp's tensor-parallel path) and AdamW —
    instead of a forward and backward with a DP gradient average.
    """

    def __init__(
        self, name: str, case: Case, sp_size: int, accelerator: Any, train_step: bool = False
    ) -> None:
        from ..accelerate import default_ulysses_size
        from ..parallel.mesh import build_mesh
        from ..parallel.runtime import SeqParallel

        self.name = name
        self.case = case
        self.ulysses = default_ulysses_size(sp_size) if name == "usp" else None
        self.mesh = build_mesh(sp_size, accelerator, ulysses_size=self.ulysses)
        model = copy.deepcopy(case.model)
        if name == PEER:
            from .peer import DeepSpeedUlysses

            self.sp: Any = DeepSpeedUlysses(self.mesh)
        else:
            self.sp = SeqParallel(self.mesh, name)
        self.optimisation_step = None
        if train_step and name != PEER:
            from ..train import GradientSync, OptimisationStep

            sync = GradientSync(accelerator, self.mesh, self.sp)
            model = sync.shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, optimizer = sync.prepare(model, optimizer)
            self.optimisation_step = OptimisationStep(accelerator, model, optimizer, sync)
        elif name == "megatron_sp" and sp_size > 1:
            from ..parallel.methods.megatron import parallelize_megatron

            model = parallelize_megatron(model, self.sp.group)
        self.model = model
        self.inputs = case.shard_batch(self.mesh.dp_rank, self.mesh.dp_size)
        self.times: list[float] = []

    def _sync_dp(self) -> None:
        """Data-parallel gradient averaging (one flat all-reduce over the DP group)."""
        if self.mesh.dp_size == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat /= self.mesh.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def traced_step(self) -> dict[str, Any]:
        """The warm-up step: bytes by phase, activation memory, loss and the gathered output."""
        from ..parallel.trace import SavedTensorMeter, trace_comm

        self.model.zero_grad(set_to_none=True)
        peer = None
        with trace_comm() as tracer:
            if self.name == PEER:
                from .peer import count_deepspeed_bytes

                peer_ctx = count_deepspeed_bytes()
                peer = peer_ctx.__enter__()
            try:
                if self.optimisation_step is not None:
                    meter = SavedTensorMeter(self.model.parameters())
                    outputs = []

                    def loss_fn() -> torch.Tensor:
                        loss, out = self.case.step(self.model, self.sp, self.inputs)
                        outputs.append(out)
                        return loss

                    loss, out = self.optimisation_step(loss_fn, meter), outputs[0]
                else:
                    with SavedTensorMeter(self.model.parameters()) as meter:
                        loss, out = self.case.step(self.model, self.sp, self.inputs)
                    if peer is not None:
                        peer.phase = "backward"
                    loss.backward()
            finally:
                if peer is not None:
                    peer_ctx.__exit__(None, None, None)
        if self.optimisation_step is None:
            self._sync_dp()
        model_bytes = {
            ph: sum(r.bytes_sent for r in tracer.records if r.op in MODEL_OPS and r.phase == ph)
            for ph in ("forward", "backward")
        }
        if peer is not None:  # DeepSpeed's own all-to-alls, counted at its comm layer
            for ph in model_bytes:
                model_bytes[ph] += peer.bytes[ph]
        total = sum(r.bytes_sent for r in tracer.records) + (
            sum(peer.bytes.values()) if peer else 0
        )
        with torch.no_grad():
            full = self.sp.exit(out.with_tensor(out.tensor.detach()))
        return {
            "fwd_bytes": model_bytes["forward"],
            "bwd_bytes": model_bytes["backward"],
            "all_bytes": total,
            "activation_bytes": meter.bytes,
            "loss": float(loss.detach()),
            "output": full,
        }

    def timed_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if self.optimisation_step is not None:
            self.optimisation_step(lambda: self.case.step(self.model, self.sp, self.inputs)[0])
        else:
            loss, _ = self.case.step(self.model, self.sp, self.inputs)
            loss.backward()
            self._sync_dp()
        self.times.append(time.perf_counter() - start)

    def formula(self, rank_in_sp: int) -> dict[str, float]:
        """The cost model for this rank: bytes (comm_bytes, exact) and activation memory."""
        from ..costmodel import activation_bytes, comm_bytes

        name = "ulysses" if self.name == PEER else self.name
        per_group = self.case.batch // self.mesh.dp_size
        wl = self.case.workload(per_group)
        n = self.mesh.sp_size
        counts = comm_bytes(
            wl, name, n, rank_in_sp, ulysses_size=self.ulysses or 1, exit_gather=False
        )
        return {
            "fwd": counts.bytes(phase="forward"),
            "bwd": counts.bytes(phase="backward"),
            "activation": activation_bytes(wl, name, n, rank_in_sp),
        }


# -- modes ---------------------------------------------------------------------------------------
def choose_layout(args: argparse.Namespace, world: int) -> tuple[int, int, str]:
    """``(sp, global batch, note)`` of the mode.

    ``sp``: SP = every process, batch ``--batch``. ``weak``: SP = every process, batch
    ``--batch`` × N (the work per rank stays fixed as N grows). ``strong``: SP = every process,
    batch ``--batch`` (fixed work), plus a one-process baseline for the speed-up.
    ``end-to-end``: global batch ``--batch`` × N over ``sp × dp = N``, with the smallest SP
    whose predicted memory per rank (activations + parameters, gradients, Adam: whole on
    every rank, as under DDP) fits ``--memory-budget-mib`` (the DSP paper's rule); its steps
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
            wl.params, param_itemsize=4, grad_itemsize=4, shard=world, zero=0
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


def select_strategies(requested: str, case: Case, sp: int) -> tuple[list[str], dict[str, str]]:
    """Strategies to run (``dsp`` first: the reference) and the skipped ones with reasons."""
    from ..parallel.strategies import STRATEGIES as REGISTERED

    if sp == 1:
        return ["dsp"], {"*": "SP 1: pure data parallelism, every strategy is the same"}
    names = list(STRATEGIES) if requested == "all" else [s.strip() for s in requested.split(",")]
    run, skipped = [], {}
    for name in names:
        if name == PEER:
            continue
        if name not in REGISTERED:
            skipped[name] = "not a registered strategy"
        elif name == "megatron_sp" and not any(
            getattr(type(m), "TP_PLAN", None) for m in case.model.modules()
        ):
            skipped[name] = f"{type(case.model).__name__} declares no TP_PLAN linears"
        elif name == "megatron_sp" and case.model.config.heads % sp:
            skipped[name] = f"heads {case.model.config.heads} not divisible by SP {sp}"
        else:
            run.append(name)
    if "dsp" not in run:
        run.insert(0, "dsp")
    run.sort(key=lambda s: s != "dsp")
    return run, skipped


def peer_status(args: argparse.Namespace, case: Case, sp: int) -> str | None:
    """``None`` when the DeepSpeed peer runs, else why not (reported, never silent)."""
    from ..costmodel import make_plan
    from .peer import deepspeed_available, deepspeed_cannot_run

    if args.peer == "off":
        return "--peer off"
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
def _stats(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {
        "median": statistics.median(times),
        "q1": q[0],
        "q3": q[2],
        "min": min(times),
        "max": max(times),
    }


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
            times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the benchmark in this process; rank 0 returns the results, the others ``None``."""
    from ..accelerate import setup_accelerate

    accelerator, world_mesh, _ = setup_accelerate(sp_size=1, seed=args.seed)
    world, rank = world_mesh.world_size, world_mesh.rank
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    sp_size, batch, layout = choose_layout(args, world)
    case = build_case(args, batch)
    names, skipped = select_strategies(args.strategies, case, sp_size)
    why_not = peer_status(args, case, sp_size)
    if why_not is None:
        from .peer import init_deepspeed

        init_deepspeed()
        names.append(PEER)
    else:
        skipped[PEER] = why_not
    train_step = args.mode == "end-to-end"
    runners = [Runner(n, case, sp_size, accelerator, train_step) for n in names]
    main = rank == 0
    bar = None
    if main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(runners) * (args.warmup + args.reps), desc="bench", unit="step")
    mine: dict[str, dict[str, Any]] = {}
    for r in runners:  # warm-up 1: traced and metered
        mine[r.name] = r.traced_step()
        if bar:
            bar.set_postfix_str(r.name)
            bar.update()
    for i in range(args.warmup - 1 + args.reps):  # interleaved, order rotated per repetition
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
    reference = mine["dsp"]["output"]
    for r in runners:
        m = mine[r.name]
        m["max_abs_diff"] = float((m.pop("output") - reference).abs().max())
        m["times"] = r.times
        m["formula"] = r.formula(r.mesh.sp_rank)
    base_times = None
    if args.mode == "strong":
        if main:
            base_times = baseline_time(case, 1, args.reps)
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    result = None
    if main:
        result = summarise(args, case, gathered, names, skipped, sp_size, world, layout)
        result["threads_per_process"] = threads
        if base_times:
            result["baseline_sp1"] = _stats(base_times)
    accelerator.wait_for_everyone()
    return result


def summarise(args, case, gathered, names, skipped, sp, world, layout) -> dict[str, Any]:
    """Worst-rank figures per strategy; step time of a repetition = its slowest rank's."""
    dp = world // sp
    rows = []
    for name in names:
        per = [g[name] for g in gathered]
        steps = [max(t) for t in zip(*(p["times"] for p in per))]
        traced = [p["fwd_bytes"] + p["bwd_bytes"] for p in per]
        formula = [p["formula"]["fwd"] + p["formula"]["bwd"] for p in per]
        row = {
            "strategy": name,
            "times": steps,
            "time": _stats(steps),
            "tokens_per_s": case.tokens / statistics.median(steps),
            "bytes_fwd": max(p["fwd_bytes"] for p in per),
            "bytes_bwd": max(p["bwd_bytes"] for p in per),
            "bytes": max(traced),
            "bytes_all_ops": max(p["all_bytes"] for p in per),
            "formula_bytes": max(formula),
            "formula_exact": traced == formula,
            "activation_bytes": max(p["activation_bytes"] for p in per),
            "formula_activation_bytes": max(p["formula"]["activation"] for p in per),
            "max_abs_diff": max(p["max_abs_diff"] for p in per),
            "loss": statistics.mean(p["loss"] for p in per),
        }
        rows.append(row)
    dsp = rows[0]
    for row in rows:
        row["vs_dsp"] = {
            "time": row["time"]["median"] / dsp["time"]["median"],
            "tokens_per_s": row["tokens_per_s"] / dsp["tokens_per_s"],
            "bytes": row["bytes"] / dsp["bytes"] if dsp["bytes"] else float("nan"),
            "activation": row["activation_bytes"] / dsp["activation_bytes"],
        }
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
        "rows": rows,
        "skipped": skipped,
        "args": vars(args),
        "command": reproduce_command(args, world),
    }
    if args.cluster != "none":
        add_prediction(result, case, args.cluster)
    return result


def add_prediction(result: dict[str, Any], case: Case, cluster: str) -> None:
    """The cost model's step time on ``cluster`` beside the measured median, and its error."""
    from ..costmodel import get_cluster, predict

    cl = get_cluster(cluster)
    sp, dp = result["sp"], result["dp"]
    wl = case.workload(case.batch // dp)
    errors = []
    for row in result["rows"]:
        name = "ulysses" if row["strategy"] == PEER else row["strategy"]
        try:
            p = predict(wl, name, sp, cl, dp=dp)
        except Exception as exc:  # a strategy the model cannot describe: say so
            row["prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        measured = row["time"]["median"]
        err = (p.step_s - measured) / measured
        row["prediction"] = {
            "step_s": p.step_s,
            "compute_s": p.compute_s,
            "comm_s": p.comm_s,
            "error": err,
        }
        errors.append(abs(err))
    result["cluster"] = {k: v for k, v in cl.__dict__.items()}
    if errors:
        result["prediction_error"] = {
            "median_abs": statistics.median(errors),
            "max_abs": max(errors),
        }


def reproduce_command(args: argparse.Namespace, world: int) -> str:
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    script = os.path.relpath(sys.argv[0]) if sys.argv[0].endswith(".py") else "scripts/benchmark.py"
    return (
        f"accelerate launch --multi_gpu --num_processes {world} --num_machines 1 "
        f"--mixed_precision no --dynamo_backend no {script} {argv}"
    ).strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmark.py",
        description="Every sequence-parallel strategy on the same model, weights and inputs "
        "(see docs/benchmark.md).",
    )
    p.add_argument("--model", default="stdit-mini", help="stdit-* / latte-* / bytelm-tiny|small")
    p.add_argument("--mode", choices=MODES, default="sp")
    p.add_argument("--frames", type=int, default=16, help="video: latent frames T")
    p.add_argument("--latent", type=int, default=32, help="video: latent H = W (S = (H/2)²)")
    p.add_argument("--seq-len", type=int, default=1024, help="text: bytes per sample")
    p.add_argument("--batch", type=int, default=1, help="samples per step (per N in weak/e2e)")
    p.add_argument("--strategies", default="all", help="comma-separated, or 'all'")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps (the first is traced)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores/N)")
    p.add_argument("--memory-budget-mib", type=float, default=256, help="end-to-end: per rank")
    p.add_argument("--peer", choices=("auto", "on", "off"), default="auto",
                   help="DeepSpeed-Ulysses peer row (auto: when deepspeed imports)")  # fmt: skip
    p.add_argument("--cluster", default="this-cpu", help="cost-model cluster to compare ('none')")
    p.add_argument("--out", default="outputs/bench", help="folder for results.json/.md/.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``scripts/benchmark.py`` (every launched process calls it)."""
    from .report import write_report

    args = build_parser().parse_args(argv)
    if args.warmup < 1 or args.reps < 1:
        raise SystemExit("--warmup and --reps must be ≥ 1")
    result = run(args)
    if result is not None:
        write_report(result, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()

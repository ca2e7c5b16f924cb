"""CPU benchmark of the selective-scan kernels against sequential and published torch paths.

One process, interleaved repetitions (every variant once per round, rounds repeated, after one
untimed warm-up round that also measures memory), median wall time of forward and of
forward + backward, the activation memory each variant keeps for backward (bytes of distinct
saved storages, :class:`dspzoo.core.parallel.trace.SavedTensorMeter`) and its peak memory
(:class:`PeakMemory`: the most bytes of tensor storage alive at once during forward +
backward, inputs excluded; CPU tensors have no allocator statistics)::

    python scripts/bench_scan.py                       # L = 4096 and 16384, 3 rounds
    python scripts/bench_scan.py --kernels mamba1 --lengths 4096 --rounds 5 --threads 1

Mamba-1: batch 1, d_inner 256, state 16, input-dependent B/C, D, z, softplus(Δ + bias).
Variants: ``ours`` (:func:`selective_scan`), ``ours-before`` (its chunked scan as before the
speed-up: ``x · exp(−S)`` instead of ``x / exp(S)``), and when installed ``transformers``
(``modeling_mamba.mamba_selective_scan``'s slow path: the sequential loop of
``MambaMixer.slow_forward``) and ``pscan`` (mambapy's parallel scan on the discretised tensors,
as transformers' ``use_mambapy`` path does); ``sequential`` (the same loop written here) only
when transformers is missing or with ``--own-sequential``.

Mamba-2 (SSD) at mamba2-130m's head shape: 24 heads × head_dim 64, state 128, one group, chunk
256. Variants: ``ours`` (:func:`ssd_scan`), ``ours-before`` (the same with the chunk-local
segment sum as it was before the speed-up: a cumulative sum over every ``[T, T]`` block),
when installed ``transformers`` (``modeling_mamba2.mamba2_chunk_scan``: ``Mamba2Mixer``'s
``torch_forward`` scan), and ``sequential`` (one step at a time; up to
``--skip-sequential-above``).

The step-by-step loops' backward is quadratic in ``L`` (every step's slice of a ``[B, L, …]``
tensor gets a full-size gradient), so above ``--sequential-forward-above`` they are timed
forward only (their fwd+bwd cells read ``fwd only``; memory is forward's)::

    python scripts/bench_scan.py --kernels mamba1 --lengths 16384 --sequential-forward-above 4096

A missing peer (transformers, mambapy) is named and skipped. Ratios are ``variant time / ours``
(> 1: ours is faster), taken on CPU time: on a shared, oversubscribed machine a process's
CPU time (one thread) measures its work where wall time measures the queue; wall time is shown.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dspzoo.core.layers import scan as scan_module
from dspzoo.core.layers.scan import selective_scan, ssd_scan
from dspzoo.core.parallel.trace import SavedTensorMeter, format_bytes

Inputs = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- Mamba-1


def mamba1_inputs(length: int, dim: int = 256, nstate: int = 16, seed: int = 0) -> Inputs:
    """Mamba-shaped inputs: Δ around softplus⁻¹(0.01..0.1), A = -(1..N) as at init."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    return dict(
        u=r(1, dim, length),
        delta=r(1, dim, length, scale=0.5),
        A=(-torch.arange(1, nstate + 1.0).repeat(dim, 1)).requires_grad_(),
        B=r(1, nstate, length),
        C=r(1, nstate, length),
        D=r(dim),
        z=r(1, dim, length),
        delta_bias=(torch.full((dim,), -3.0) + torch.rand(dim, generator=g)).requires_grad_(),
    )


def mamba1_ours(t: Inputs) -> torch.Tensor:
    return selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                          t["delta_bias"], delta_softplus=True)  # fmt: skip


def _chunked_states_before(
    delta: torch.Tensor, A: torch.Tensor, x: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:
    """``scan._chunked_states`` before the speed-up: ``x · exp(−S)`` (a second exponential and a
    negation of the ``[B, L, D, N]`` log-decays) instead of ``x / exp(S)``."""
    length = x.shape[1]
    chunk = scan_module._chunk_length(delta, A.abs().amax(-1), scan_module._SAFE_LOG_DECAY[x.dtype])
    if chunk == 1:
        return scan_module._log_step_scan(delta, A, x, h0)
    chunk = min(chunk, length)
    pad = (-length) % chunk
    delta = F.pad(delta, (0, 0, 0, pad)).unflatten(1, (-1, chunk))
    x = F.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, chunk))
    log_growth = delta.cumsum(2).unsqueeze(-1) * A
    weighted = torch.cumsum(x * torch.exp(-log_growth), dim=2)
    growth = torch.exp(log_growth)
    if weighted.shape[1] == 1:
        incoming = h0.unsqueeze(1)
    else:
        ends = _chunked_states_before(delta.sum(2), A, growth[:, :, -1] * weighted[:, :, -1], h0)
        incoming = torch.cat([h0.unsqueeze(1), ends[:, :-1]], dim=1)
    states = growth.mul_(weighted.add_(incoming.unsqueeze(2)))
    return states.flatten(1, 2)[:, :length]


def _discretise(t: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``exp(ΔA)`` and ``Δ B u`` as ``[B, L, D, N]``, and Δ (shared by the baselines)."""
    dt = F.softplus(t["delta"] + t["delta_bias"][:, None])  # [B, D, L]
    decay = torch.exp(dt.transpose(1, 2)[..., None] * t["A"])
    drive = (dt * t["u"]).transpose(1, 2)[..., None] * t["B"].transpose(1, 2)[:, :, None]
    return decay, drive, dt


def _finish(states_y: torch.Tensor, t: Inputs) -> torch.Tensor:
    return (states_y + t["u"] * t["D"][:, None]) * F.silu(t["z"])


def mamba1_sequential(t: Inputs) -> torch.Tensor:
    """The recurrence one step at a time (what the scan replaces)."""
    decay, drive, _ = _discretise(t)
    state = torch.zeros_like(drive[:, 0])
    ys = []
    for step in range(drive.shape[1]):
        state = decay[:, step] * state + drive[:, step]
        ys.append(state @ t["C"][:, :, step, None])
    return _finish(torch.cat(ys, -1), t)


def mamba1_pscan(t: Inputs) -> torch.Tensor:
    from mambapy.pscan import pscan

    decay, drive, _ = _discretise(t)
    states = pscan(decay, drive)  # [B, L, D, N]
    y = (states @ t["C"].transpose(1, 2)[..., None]).squeeze(-1).transpose(1, 2)
    return _finish(y, t)


def mamba1_transformers(t: Inputs) -> torch.Tensor:
    from transformers.models.mamba import modeling_mamba

    fn = modeling_mamba.mamba_selective_scan
    fn = getattr(fn, "__wrapped__", fn)
    return fn(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"],
              delta_bias=t["delta_bias"], delta_softplus=True, use_mambapy=False)  # fmt: skip


# ----------------------------------------------------------------------------- Mamba-2 (SSD)

SSD_SHAPE = dict(heads=24, headdim=64, nstate=128, groups=1, chunk=256)  # mamba2-130m


def ssd_inputs(length: int, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    h, p, n, gr = (SSD_SHAPE[k] for k in ("heads", "headdim", "nstate", "groups"))

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    return dict(
        x=r(1, length, h, p),
        dt=r(1, length, h, scale=0.5),
        A=(-torch.arange(1, h + 1.0)).requires_grad_(),
        B=r(1, length, gr, n, scale=n**-0.5),
        C=r(1, length, gr, n, scale=n**-0.5),
        D=r(h),
        dt_bias=(torch.full((h,), -3.0) + torch.rand(h, generator=g)).requires_grad_(),
    )


def ssd_ours(t: Inputs) -> torch.Tensor:
    return ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], SSD_SHAPE["chunk"], D=t["D"],
                    dt_bias=t["dt_bias"], dt_softplus=True)  # fmt: skip


def _segment_sum_before(log_decay: torch.Tensor) -> torch.Tensor:
    """``scan._segment_sum`` before the speed-up: a cumulative sum over every ``[T, T]`` block."""
    length = log_decay.shape[-1]
    strict = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = log_decay.unsqueeze(-1).expand(*log_decay.shape, length).masked_fill(~strict, 0)
    sums = sums.cumsum(-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


@contextmanager
def _patched(module: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def mamba1_ours_before(t: Inputs) -> torch.Tensor:
    with _patched(scan_module, "_chunked_states", _chunked_states_before):
        return mamba1_ours(t)


def ssd_ours_before(t: Inputs) -> torch.Tensor:
    with _patched(scan_module, "_segment_sum", _segment_sum_before):
        return ssd_ours(t)


def ssd_sequential(t: Inputs) -> torch.Tensor:
    dt = F.softplus(t["dt"] + t["dt_bias"])  # [B, L, H]
    per_group = SSD_SHAPE["heads"] // SSD_SHAPE["groups"]
    Bh, Ch = (t[k].repeat_interleave(per_group, dim=2) for k in ("B", "C"))
    x = t["x"]
    state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], Bh.shape[-1])
    ys = []
    for step in range(x.shape[1]):
        decay = torch.exp(dt[:, step] * t["A"])[..., None, None]
        state = (
            decay * state + (dt[:, step, :, None] * x[:, step])[..., None] * Bh[:, step, :, None]
        )
        ys.append(state @ Ch[:, step, :, :, None])
    return torch.cat(ys, -1).movedim(-1, 1) + x * t["D"][:, None]


def ssd_transformers(t: Inputs) -> torch.Tensor:
    from transformers.models.mamba2 import modeling_mamba2

    fn = modeling_mamba2.mamba2_chunk_scan
    fn = getattr(fn, "__wrapped__", fn)
    return fn(t["x"], t["dt"], t["A"], t["B"], t["C"], SSD_SHAPE["chunk"], D=t["D"],
              dt_bias=t["dt_bias"], dt_softplus=True)  # fmt: skip


# ----------------------------------------------------------------------------- harness


class PeakMemory(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among storages created inside.

    Every op's outputs are seen at dispatch (backward's too: autograd runs CPU work on the
    calling thread with the mode active); a storage counts from its creation until it is freed
    (a weak reference's callback). Tensors created before entering (the inputs) are excluded.
    The bookkeeping costs Python time per op, so the timed runs go without it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        size = storage.nbytes()

        def freed(_: weakref.ref, key: int = key, size: int = size) -> None:
            if self._alive.pop(key, None) is not None:
                self.live -= size

        self._alive[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)


def _forward_backward(fn: Callable[[Inputs], torch.Tensor], t: Inputs) -> torch.Tensor:
    out = fn(t)
    grads = torch.autograd.grad(out.float().pow(2).sum(), list(t.values()), allow_unused=True)
    del grads
    return out.detach()


def measure_memory(
    fn: Callable[[Inputs], torch.Tensor], t: Inputs, backward: bool = True
) -> tuple[int, int]:
    """Saved-for-backward bytes and peak bytes of forward + backward (of forward alone when not
    ``backward``), one untimed run."""
    leaves = list(t.values())
    with PeakMemory() as peak:
        with SavedTensorMeter(exclude=leaves) as meter:
            out = fn(t)
        saved = meter.bytes
        if backward:
            grads = torch.autograd.grad(out.float().pow(2).sum(), leaves, allow_unused=True)
            del grads
        del out
    return saved, peak.peak


def run_once(
    fn: Callable[[Inputs], torch.Tensor], t: Inputs, backward: bool = True
) -> tuple[list[float], torch.Tensor]:
    """``[forward, forward + backward]`` in CPU seconds of this process, the same in wall
    seconds, and the output (forward + backward ``nan`` when not ``backward``)."""
    leaves = list(t.values())
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(t)
    forward = [time.process_time() - cpu, time.perf_counter() - wall]
    total = [float("nan")] * 2
    if backward:
        grads = torch.autograd.grad(out.float().pow(2).sum(), leaves, allow_unused=True)
        total = [time.process_time() - cpu, time.perf_counter() - wall]
        del grads
    return [forward[0], total[0], forward[1], total[1]], out.detach()


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


SEQUENTIAL = ("transformers", "sequential")  # the step-by-step loops (slowest by far)


def bench(
    title: str,
    variants: dict[str, Callable],
    t: Inputs,
    rounds: int,
    sequential_rounds: int,
    forward_only: frozenset[str] = frozenset(),
) -> dict[str, dict]:
    """One warm-up round (memory), then ``rounds`` interleaved timed rounds; prints a table.

    Times are medians over the rounds of this process's CPU time (one thread: the work done,
    whatever else the shared machine runs) and, for reference, of wall time. The step-by-step
    loops (:data:`SEQUENTIAL`) run only in the first ``sequential_rounds`` rounds. Every run's
    times go to stderr as they come (a run stopped by a time limit keeps what it measured).
    Variants in ``forward_only`` run forward alone (time, saved bytes and peak of forward).
    """
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    memory: dict[str, tuple[int, int]] = {}
    outputs: dict[str, torch.Tensor] = {}
    load_before = load_average()
    for name, fn in variants.items():  # warm-up round: imports, allocator, memory
        memory[name] = measure_memory(fn, t, name not in forward_only)
        print(
            f"  warm-up {name}: peak {format_bytes(memory[name][1])}", file=sys.stderr, flush=True
        )
    for i in range(rounds):  # interleaved: each round runs every variant once
        for name, fn in variants.items():
            if name in SEQUENTIAL and i >= sequential_rounds:
                continue
            measured, out = run_once(fn, t, name not in forward_only)
            times[name].append(measured)
            outputs[name] = out
            print(f"  round {i} {name}: fwd {measured[0]:.3f}, fwd+bwd {measured[1]:.3f} CPU s, "
                  f"{measured[3]:.2f} wall s", file=sys.stderr, flush=True)  # fmt: skip
    medians = {n: [statistics.median(col) for col in zip(*ts)] for n, ts in times.items()}
    ours = medians["ours"]
    print(f"\n{title}  (load average {load_before} before, {load_average()} after)")
    print(
        "| variant | forward CPU s | fwd+bwd CPU s | fwd ratio | fwd+bwd ratio | fwd+bwd wall s "
        "| saved for backward | peak fwd+bwd | max |Δ| vs ours |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name in variants:
        f, tt, fwall, wall = medians[name]
        diff = (
            (outputs[name] - ref).abs().max().item() if (ref := outputs["ours"]) is not None else 0
        )
        saved, peak = memory[name]
        rows[name] = dict(forward=f, total=tt, wall=wall, saved=saved, peak=peak, diff=diff)
        ratio = f"{f / ours[0]:.2f}×"
        if name in forward_only:  # fwd+bwd CPU s, fwd ratio, fwd+bwd ratio, fwd+bwd wall s
            cells = [
                "fwd only",
                ratio,
                "—",
                f"{fwall:.2f} (fwd)",
                format_bytes(saved),
                f"{format_bytes(peak)} (fwd)",
            ]
        else:
            cells = [f"{tt:.3f}", ratio, f"{tt / ours[1]:.2f}×", f"{wall:.2f}",
                     format_bytes(saved), format_bytes(peak)]  # fmt: skip
        print(f"| {name} | {f:.3f} | " + " | ".join(cells) + f" | {diff:.1e} |")
    sys.stdout.flush()
    return rows


def peers() -> dict[str, bool]:
    """Which optional peers import; a missing one is named (and its variants skipped)."""
    has = {m: importlib.util.find_spec(m) is not None for m in ("transformers", "mambapy")}
    for name, present in has.items():
        if not present:
            print(f"peer missing: {name} (pip install {name}); its variants are skipped")
    return has


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kernels", nargs="+", choices=("mamba1", "ssd"), default=["mamba1", "ssd"]
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--ssd-lengths", type=int, nargs="+", default=None,
                        help="lengths for the SSD scan (default: --lengths)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential-rounds", type=int, default=None,
                        help="timed rounds of the step-by-step loops (default: --rounds)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--skip-sequential-above", type=int, default=1 << 30,
                        help="drop the sequential loops for longer sequences")  # fmt: skip
    parser.add_argument("--sequential-forward-above", type=int, default=1 << 30,
                        help="time the step-by-step loops' forward only for longer sequences "
                        "(their backward is quadratic in L: every step's slice gets a "
                        "full-size gradient)")  # fmt: skip
    parser.add_argument("--no-before", action="store_true",
                        help="drop the ours-before variants (the speed-ups' baselines)")  # fmt: skip
    parser.add_argument("--own-sequential", action="store_true",
                        help="Mamba-1: also run this script's own loop beside transformers'")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"threads {args.threads}, rounds {args.rounds}")  # fmt: skip
    print("command: python scripts/bench_scan.py " + shlex.join(sys.argv[1:]))
    has = peers()
    seq_rounds = args.rounds if args.sequential_rounds is None else args.sequential_rounds
    if "mamba1" in args.kernels:
        for length in args.lengths:
            variants: dict[str, Callable] = {"ours": mamba1_ours}
            if not args.no_before:
                variants["ours-before"] = mamba1_ours_before
            if length <= args.skip_sequential_above:
                if has["transformers"]:
                    variants["transformers"] = mamba1_transformers
                if args.own_sequential or not has["transformers"]:
                    variants["sequential"] = mamba1_sequential
            if has["mambapy"]:
                variants["pscan"] = mamba1_pscan
            fwd_only = SEQUENTIAL if length > args.sequential_forward_above else ()
            bench(f"Mamba-1 selective scan, L={length}, d_inner 256, state 16, batch 1",
                  variants, mamba1_inputs(length), args.rounds, seq_rounds,
                  frozenset(fwd_only))  # fmt: skip
    if "ssd" in args.kernels:
        for length in args.ssd_lengths or args.lengths:
            variants = {"ours": ssd_ours}
            if not args.no_before:
                variants["ours-before"] = ssd_ours_before
            if has["transformers"]:
                variants["transformers"] = ssd_transformers
            if length <= args.skip_sequential_above:
                variants["sequential"] = ssd_sequential
            fwd_only = ("sequential",) if length > args.sequential_forward_above else ()
            bench(f"Mamba-2 SSD scan, L={length}, mamba2-130m heads (24 × 64, state 128), batch 1",
                  variants, ssd_inputs(length), args.rounds, seq_rounds,
                  frozenset(fwd_only))  # fmt: skip


if __name__ == "__main__":
    main()

"""The shared attention kernel on one device: fused vs blockwise vs plain SDPA, forward + backward.

One causal attention ``[1, L, H, D]`` over positions ``0 … L−1`` through
:func:`~dspzoo.core.parallel.methods.kernels.kernel_attention` with ``kernel="fused"`` (on the
CPU PyTorch's fused CPU attention; on CUDA FlashAttention-2 in half precision, else the
memory-efficient kernel), ``fused-cudnn``, ``fused-flash``, ``fused-efficient`` (CUDA only:
the fused kernel held to one CUDA kernel; cuDNN's is opt-in; one the GPU does not take gets
a row saying why) and ``kernel="blockwise"`` (the einsum kernel, ``--chunk`` tokens per score
block), beside ``F.scaled_dot_product_attention`` (no log-sum-exp: what a single device would
run without sequence parallelism). They run interleaved, in a rotated order each repetition;
the table gives the median time (synchronised on CUDA), the peak memory the call added
(CUDA allocator; on the CPU not measured), each one's error against SDPA in float64 on a
small problem (output and input gradients), and the ratios to SDPA::

    python scripts/bench_kernel_device.py --device cuda --seq-len 16384 --dtype bfloat16
    python scripts/bench_kernel_device.py --device cpu --seq-len 2048 --reps 3   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspzoo.core.argparser import CommandParser, non_negative_int, positive_int
from dspzoo.core.device_memory import CudaPeak
from dspzoo.core.entry import UsageError, run_entry_point
from dspzoo.core.parallel.methods.kernels import (
    CUDA_BACKENDS,
    FusedKernel,
    cuda_refusal,
    kernel_attention,
)
from dspzoo.core.progress import progress_bar

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# sdpa: plain SDPA; fused: the methods' default kernel (on CUDA in half precision
# FlashAttention-2, else the memory-efficient kernel); fused-cudnn, fused-flash,
# fused-efficient: the fused kernel held to that CUDA kernel (fused-efficient: what ``fused``
# ran in half precision before 28 Nov 2026); blockwise: the einsum kernel
KERNELS = ("sdpa", "fused", *(f"fused-{b}" for b in CUDA_BACKENDS[1:]), "blockwise")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal SDPA on ``[B, L, H, D]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)


def _call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """One causal attention ``[1, L, H, D]`` through kernel ``name`` (:data:`KERNELS`)."""
    scale = q.shape[-1] ** -0.5
    if name == "sdpa":
        return _sdpa(q, k, v, scale)
    pos = torch.arange(q.shape[1])
    kernel = FusedKernel(name.split("-")[1]) if name.startswith("fused-") else name
    return kernel_attention(q, k, v, pos, pos, True, scale, kernel=kernel, chunk=chunk)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str, inputs: list[torch.Tensor], grad: torch.Tensor, chunk: int
) -> tuple[float, int | None]:
    """Seconds and added peak bytes (CUDA) of one forward + backward."""
    device = grad.device
    for t in inputs:
        t.grad = None
    _sync(device)
    with CudaPeak(device) as peak:
        start = time.perf_counter()
        out = _call(name, *inputs, chunk)
        out.backward(grad)
        _sync(device)
        seconds = time.perf_counter() - start
    return seconds, peak.added_bytes


@dataclass
class Float64Reference:
    """Causal SDPA in float64 on the CPU, once for every kernel checked against it: inputs
    ``q, k, v`` and output gradient ``w`` ``[1, min(L, 512), H, D]``, output and input
    gradients."""

    inputs: list[torch.Tensor]
    w: torch.Tensor
    out: torch.Tensor
    grads: list[torch.Tensor]

    @classmethod
    def build(cls, args: argparse.Namespace) -> Float64Reference:
        g = torch.Generator().manual_seed(1)
        shape = (1, min(args.seq_len, 512), args.heads, args.head_dim)
        q, k, v, w = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = _sdpa(*leaves, args.head_dim**-0.5)
        out.backward(w)
        return cls([q, k, v], w, out.detach(), [t.grad for t in leaves])

    def errors(
        self, name: str, args: argparse.Namespace, device: torch.device
    ) -> tuple[float, float]:
        """Relative errors (``‖got − want‖ / ‖want‖``) of kernel ``name``'s output and input
        gradients (the worst of dq, dk, dv) in the run's dtype on ``device``."""
        dtype = DTYPES[args.dtype]
        mine = [t.to(device, dtype).requires_grad_(True) for t in self.inputs]
        got = _call(name, *mine, args.chunk)
        got.backward(self.w.to(device, dtype))

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.detach().double().cpu() - b).norm() / b.norm())

        return rel(got, self.out), max(rel(m.grad, r) for m, r in zip(mine, self.grads))


def _refused(
    names: list[str], device: torch.device, dtype: torch.dtype, head_dim: int
) -> dict[str, str]:
    """The ``fused-<backend>`` kernels of ``names`` this GPU does not take, with why (they get
    a row saying so instead of a failed run)."""
    probe = torch.empty(0, 0, 0, head_dim, device=device, dtype=dtype)
    width = FusedKernel.head_width(probe, probe)  # as the kernel pads it
    found = {n: cuda_refusal(n.split("-", 1)[1], probe, width) for n in names}
    return {n: why for n, why in found.items() if why is not None}


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens L (default: 16384 on CUDA, 2048 on the CPU, which takes minutes at 16K)",
    )
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads H")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head size D")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="the inputs' dtype (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    p.add_argument(
        "--chunk", type=positive_int, default=1024, help="blockwise: tokens per score block"
    )
    p.add_argument("--reps", type=positive_int, default=10, help="timed repetitions of each kernel")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed repetitions first")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    p.add_argument(
        "--kernels", default="sdpa,fused,blockwise", help=f"comma-separated, of {','.join(KERNELS)}"
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.kernels.split(",")) - set(KERNELS))
    if unknown:
        raise UsageError(
            f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}"
        )
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: choose cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available; use --device cpu")
    on_cuda = device.type == "cuda"
    args.seq_len = args.seq_len or (16384 if on_cuda else 2048)
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    names = args.kernels.split(",")
    on_cuda_only = [n for n in names if n.startswith("fused-")]
    if not on_cuda and on_cuda_only:
        raise UsageError(
            f"--kernels {','.join(on_cuda_only)}: these hold the fused kernel to one CUDA kernel; "
            "the CPU has one fused kernel: use fused"
        )
    refused = _refused(on_cuda_only, device, DTYPES[args.dtype], args.head_dim)
    names = [n for n in names if n not in refused]
    if not names:
        reasons = "; ".join(f"{n} needs {why}" for n, why in refused.items())
        raise UsageError(f"--kernels: this GPU takes none of them ({reasons})")
    g = torch.Generator().manual_seed(0)
    shape = (1, args.seq_len, args.heads, args.head_dim)
    dtype = DTYPES[args.dtype]
    inputs = [
        torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3)
    ]
    grad = torch.randn(shape, generator=g).to(device, dtype)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int | None] = {}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"causal attention forward + backward, L {args.seq_len}, {args.heads} heads × "
        f"{args.head_dim}, {args.dtype}, on {where} (torch {torch.__version__}), "
        f"{args.warmup} warm-up and {args.reps} interleaved repetitions:\n",
        flush=True,
    )
    calls = (args.warmup + args.reps) * len(names)
    with progress_bar(total=calls, desc="kernels", unit="call", disable=args.no_progress) as bar:
        for i in range(args.warmup + args.reps):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                seconds, peak = measure(name, inputs, grad, args.chunk)
                if i >= args.warmup:
                    times[name].append(seconds)
                    peaks[name] = peak if peak is None else max(peak, peaks.get(name) or 0)
                bar.update()
    first = statistics.median(times[names[0]])
    print(
        f"| kernel | median ms | × {names[0]} | peak added MiB | "
        "rel. error out / grads (own problem of min(L, 512) tokens, vs fp64) |"
    )
    print("|---|---|---|---|---|")
    reference = Float64Reference.build(args)
    for name in names:
        med = statistics.median(times[name])
        peak = "–" if peaks.get(name) is None else f"{peaks[name] / 2**20:,.0f}"
        err_out, err_grad = reference.errors(name, args, device)
        print(
            f"| {name} | {med * 1e3:.2f} | {med / first:.2f} | {peak} | "
            f"{err_out:.1e} / {err_grad:.1e} |"
        )
    for name, why in refused.items():
        print(f"| {name} | refused: needs {why} | | | |")
    given = sys.argv[1:] if argv is None else argv
    print("\nreproduce: python scripts/bench_kernel_device.py " + " ".join(given))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_entry_point(main, "bench_kernel_device.py"))

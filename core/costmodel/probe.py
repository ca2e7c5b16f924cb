"""Measure this machine's rates for the ``this-cpu`` cluster: matmul FLOP/s, streaming-copy
memory bandwidth, all-to-all α-β, and the α-β of a ``switch`` as the runtime makes it (its
layout copies included, no agreement of its own).

Two ways in, one measurement:

* :func:`probe_group` runs on every rank of a live process group (a benchmark probes its own
  SP group in the same run, at the same load, as the steps it predicts);
* :func:`~.cluster.measure_this_cpu` spawns a 2-process gloo group for it when nothing is
  running (the cached fallback of ``get_cluster("this-cpu")``).

Each collective is timed call by call behind a barrier and summarised by its median, so one
call delayed by another process's burst does not move the figure (the first version averaged
10 back-to-back calls, and one such delay made the latency 10× too large).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SMALL_ELEMENTS_PER_RANK = 1
LARGE_BYTES = 8 << 20


@dataclass(frozen=True)
class Rates:
    """What the probe measured (the slowest rank's).

    Attributes:
        flops: fp32 matmul FLOP/s of one thread.
        bandwidth: bytes/s a rank sends in an all-to-all, beyond its fixed cost.
        latency: seconds of one all-to-all of (almost) nothing: the fixed cost per collective.
        ranks: size of the group probed.
        threads: torch threads per rank the FLOP rate was measured with.
        memory_bandwidth: bytes/s read + written by a streaming copy on those threads, every
            rank copying at once (they share the memory bus, as in a step); 0: not measured
            (a cache from before this field), which turns the cost model's memory terms off.
        attention_flops: FLOP/s of the attention kernel (``scaled_dot_product_attention``
            forward + backward, counted as 3× the forward's ``4·B·H·L²·D``) at the workload's
            own shape (:class:`AttentionShape`); 0: not measured (the matmul rate prices
            attention too).
        switch_bandwidth / switch_latency: the same α-β of :func:`dspzoo.core.comm.switch` as
            the runtime makes it inside an agreed forward (no agreement of its own), layout
            work included; 0: not measured (a switch costs what the all-to-all costs).
    """

    flops: float
    bandwidth: float
    latency: float
    ranks: int
    threads: int = 1
    memory_bandwidth: float = 0.0
    attention_flops: float = 0.0
    switch_bandwidth: float = 0.0
    switch_latency: float = 0.0


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention call, ``[batch, heads, length, head_dim]`` for q, k and v."""

    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool = False


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Torch runs on ``threads`` threads inside the block (a benchmark's ranks run
    ``cores // ranks`` each, one on this 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _calls_per_second(call: Callable[[], object], seconds: float) -> float:
    """How many times ``call`` runs per second, over ``seconds`` after one warm-up call."""
    call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        count += 1
    return count / (time.perf_counter() - start)


def attention_rate(shape: AttentionShape, seconds: float = 0.3, threads: int = 1) -> float:
    """FLOP/s of fp32 ``scaled_dot_product_attention`` forward + backward at ``shape`` on
    ``threads`` torch threads, counted as the cost model counts a step's attention FLOPs (3×
    the forward's ``4·B·H·L²·D``, halved when causal). Its rate moves a lot with the shape on a
    CPU (one thread of this machine: 12 GFLOP/s at 256 × 4 × 16 × 32, 55 at 8 × 4 × 256 × 32,
    66 at 1 × 8 × 1024 × 64), so it is measured at the workload's own shape."""
    dims = (shape.batch, shape.heads, shape.length, shape.head_dim)
    q, k, v = (torch.randn(dims, requires_grad=True) for _ in range(3))
    grad = torch.ones(dims)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        out.backward(grad)

    with _torch_threads(threads):
        rate = _calls_per_second(step, seconds)
    forward = 4.0 * math.prod(dims) * shape.length * (0.5 if shape.causal else 1.0)
    return 3.0 * forward * rate


def matmul_rate(size: int = 512, seconds: float = 0.3, threads: int = 1) -> float:
    """FLOP/s of ``[size, size] @ [size, size]`` fp32 matmuls on ``threads`` torch threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    with _torch_threads(threads):
        return 2.0 * size**3 * _calls_per_second(lambda: a @ b, seconds)


def copy_rate(nbytes: int = 64 << 20, calls: int = 7, threads: int = 1) -> float:
    """Bytes/s read + written by ``dst.copy_(src)`` of ``nbytes`` fp32 (a STREAM copy: far
    larger than the caches), the median of ``calls`` copies on ``threads`` torch threads."""
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    with _torch_threads(threads):
        dst.copy_(src)  # warm-up: the pages of both are mapped
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    return 2.0 * src.numel() * 4 / statistics.median(times)


def _median_call_s(group: Any, x: torch.Tensor, calls: int) -> float:
    """Median seconds of ``all_to_all_single(x)`` over ``calls`` calls, each behind a barrier."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # warm-up: connections, buffers
    times = []
    for _ in range(calls):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_to_all_single(out, x, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_switch_s(group: Any, local_bytes: int, calls: int) -> float:
    """Median seconds of a ``switch`` of a ``[1, 2, S, 4]`` fp32 shard of ``local_bytes`` from
    sharded on axis 1 to sharded on axis 2, each call behind a barrier, as the runtime makes
    it after its entry agreement (no agreement of its own)."""
    from ..parallel.comm import switch, trusted_calls

    n = dist.get_world_size(group)
    s = max(local_bytes // (2 * 4 * 4) // n, 1) * n
    x = torch.zeros(1, 2, s, 4)
    switch(x, 1, 2, group, src_length=2 * n)  # a direct call: agreed once
    times = []
    with trusted_calls(group):
        for _ in range(calls):
            dist.barrier(group=group)
            start = time.perf_counter()
            switch(x, 1, 2, group, src_length=2 * n)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_group(
    group: Any = None,
    large_bytes: int = LARGE_BYTES,
    calls: int = 15,
    seconds: float = 0.3,
    threads: int = 1,
    attention: AttentionShape | None = None,
) -> Rates:
    """Collective: every rank of ``group`` (default: the world, of at least 2 ranks) calls it
    and gets the same :class:`Rates`.

    Latency = median time of an all-to-all of one element per rank; bandwidth = the bytes a rank
    sends in an all-to-all of ``large_bytes`` over its median time beyond that latency; FLOP/s
    of matmuls and the memory bandwidth of a streaming copy (every rank at once) on ``threads``
    threads, and with ``attention`` the attention kernel's rate at that shape. The slowest
    rank's figures are kept (a step waits for it).
    """
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        raise ValueError(
            "probe_group times collectives: call it on every rank of a group of 2 or more "
            "(outside one, measure_this_cpu() spawns a 2-process group for it)"
        )
    n = dist.get_world_size(group)
    flops = matmul_rate(seconds=seconds, threads=threads)
    dist.barrier(group=group)  # the ranks copy at the same time, sharing the memory bus
    memory = copy_rate(threads=threads)
    attn = 0.0 if attention is None else attention_rate(attention, seconds, threads)
    small = torch.zeros(n * SMALL_ELEMENTS_PER_RANK)
    large = torch.zeros(max(large_bytes // 4 // n, 1) * n)
    latency = _median_call_s(group, small, calls)
    big = _median_call_s(group, large, max(calls // 2, 3))
    small_switch = _median_switch_s(group, 16 * 4 * n, calls)
    big_switch = _median_switch_s(group, large_bytes, max(calls // 2, 3))
    # the slowest rank's: max of the times, min of the rate
    times = [latency, big, small_switch, big_switch, -flops, -memory, -attn]
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    latency, big, small_switch, big_switch = (worst[i].item() for i in range(4))
    flops, memory, attn = (-worst[i].item() for i in (4, 5, 6))
    sent = large.numel() * 4 * (n - 1) / n
    switch_sent = large_bytes * (n - 1) / n
    return Rates(
        flops,
        sent / max(big - latency, 1e-9),
        latency,
        n,
        threads,
        memory,
        attn,
        switch_sent / max(big_switch - small_switch, 1e-9),
        small_switch,
    )

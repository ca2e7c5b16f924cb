"""Clusters the cost model predicts for: compute rate, links, memory; presets and a probe.

Bandwidths are *achievable per-GPU* figures (bytes a rank can send per second in a collective,
one direction), not link peaks; latencies are per collective (``α``). Presets are from vendor
sheets with the usual derating (sources in ``docs/cost_model.md``); ``this-cpu`` is measured
(:mod:`.probe`: a matmul FLOP-rate probe and a gloo all-to-all probe): by a benchmark in its
own run, else in a 2-process group spawned for it, and cached in
``~/.cache/dspzoo/this-cpu.json``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .probe import Rates, probe_group

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster.

    Attributes:
        name: preset name.
        peak_tflops: dense peak per device in the training dtype (bf16/fp16; fp32 for CPUs).
        mfu: achievable fraction of the peak on these models' matmuls and attention.
        intra_bw / inter_bw: achievable bytes/s per device inside a node / across nodes.
        intra_lat / inter_lat: seconds per collective inside a node / across nodes.
        gpus_per_node: devices per node (an SP group of consecutive ranks stays inside one
            node while it fits).
        memory_gib: memory per device.
        overlap: fraction of communication hidden under compute (0: none).
        hbm_bw: achievable device-memory bytes/s of a streaming copy (0: the memory-bound
            terms are off) — the layout copies around each all-to-all and the element-wise
            work (norms, modulation, activations, residuals) run at this rate.
        coll_base_lat / coll_step_lat_intra / coll_step_lat_inter: NCCL's latency model of a
            collective (``src/graph/tuning.cc``, Simple protocol, ring): a base per call plus
            one step latency per ring step inside a node / across nodes (0: the plain
            ``intra_lat``/``inter_lat`` per collective).
        fused_attention: the device runs a fused (flash) attention kernel; without one
            (Volta) the score matrix goes through device memory (written and read twice).
        sp_layout: ``(sp size, fewest ranks of an SP group on one node, most nodes one SP
            group spans)`` as a real mesh placed them (:meth:`placed`); an SP group of that
            size is priced by it instead of by ``gpus_per_node``. ``None``: consecutive ranks,
            ``gpus_per_node`` to a node.
        attention_tflops: achieved TFLOP/s of the attention kernels where measured apart
            (``this-cpu`` probed at the workload's attention shape); 0: attention runs at the
            matmul rate (``peak_tflops · mfu``), as on every preset.
        switch_bw / switch_lat: bytes/s (beyond the fixed cost) and seconds per call of a
            whole ``switch``, layout work included, where measured (``this-cpu``: probed on
            the run's own group); 0, as on every preset: a switch is priced as an all-to-all
            at ``intra_bw``/``inter_bw`` plus its layout copies at ``hbm_bw``.
    """

    name: str
    peak_tflops: float
    mfu: float
    intra_bw: float
    inter_bw: float
    intra_lat: float
    inter_lat: float
    gpus_per_node: int
    memory_gib: float
    overlap: float = 0.0
    hbm_bw: float = 0.0
    coll_base_lat: float = 0.0
    coll_step_lat_intra: float = 0.0
    coll_step_lat_inter: float = 0.0
    fused_attention: bool = True
    sp_layout: tuple[int, int, int] | None = None
    attention_tflops: float = 0.0
    switch_bw: float = 0.0
    switch_lat: float = 0.0

    @property
    def flops(self) -> float:
        """Achievable FLOP/s per device."""
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def attention_flops(self) -> float:
        """Achievable FLOP/s of the attention kernels (the matmul rate unless measured)."""
        return self.attention_tflops * 1e12 if self.attention_tflops else self.flops

    def with_(self, **changes) -> Cluster:
        return replace(self, **changes)

    def placed(self, mesh: Any) -> Cluster:
        """This cluster with the SP groups where ``mesh`` (a
        :class:`~dspzoo.core.parallel.mesh.SPMesh`) put them: a node-local SP group is priced
        on the intra-node link, one spanning nodes (``DSPZOO_SP_ACROSS_NODES``) partly or
        wholly on the inter-node link."""
        return replace(
            self, sp_layout=(mesh.sp_size, mesh.sp_ranks_per_node, mesh.sp_nodes_spanned)
        )

    def link(self, group: int) -> tuple[float, float, float]:
        """``(fraction of peers off-node, intra bw, inter bw)`` for an SP group of ``group``.

        A rank's peers on its own node are ``sp_layout``'s ranks per node (minus itself) when
        the group has ``sp_layout``'s size, else ``min(group, gpus_per_node)`` (consecutive
        ranks filling nodes)."""
        if group <= 1:
            return 0.0, self.intra_bw, self.inter_bw
        if self.sp_layout is not None and self.sp_layout[0] == group:
            local = max(1, min(self.sp_layout[1], group))
        else:
            local = min(group, self.gpus_per_node)
        return (group - local) / (group - 1), self.intra_bw, self.inter_bw

    def transfer_time(self, nbytes: float, group: int, collectives: int = 0) -> float:
        """α-β time of ``nbytes`` sent per rank in ``collectives`` collectives over ``group``.

        The bytes to off-node peers go over the inter-node link, the rest over the intra-node
        link, concurrently (the slower side bounds the time); each collective costs the
        latency of the slowest link it touches.
        """
        off, intra, inter = self.link(group)
        beta = max(nbytes * (1 - off) / intra, nbytes * off / inter if off else 0.0)
        alpha = collectives * (self.inter_lat if off else self.intra_lat)
        return alpha + beta

    def collective_latency(self, op: str, group: int) -> float:
        """Seconds of latency of one collective ``op`` over ``group`` ranks (placed as
        ``sp_layout`` says when it has this size, else consecutive ranks filling nodes).

        With the NCCL constants set: ``base + steps_intra · step_intra + steps_inter ·
        step_inter``, as NCCL's tuning model prices a ring collective; all-gather and
        reduce-scatter take ``group − 1`` steps (``nodes − 1`` of them across nodes), an
        all-reduce twice that, an all-to-all or a point-to-point send one step (its
        messages to the peers go out concurrently). Without them: ``intra_lat`` /
        ``inter_lat`` per collective. An all-to-all costs ``switch_lat`` where that is set.
        """
        if group <= 1:
            return 0.0
        if op == "all_to_all" and self.switch_lat:
            return self.switch_lat
        if self.sp_layout is not None and self.sp_layout[0] == group:
            nodes = self.sp_layout[2]
        else:
            nodes = -(-group // max(self.gpus_per_node, 1))
        if not self.coll_step_lat_intra:
            return self.inter_lat if nodes > 1 else self.intra_lat
        if op in ("all_gather", "reduce_scatter"):
            steps, inter = group - 1, nodes - 1
            return (
                self.coll_base_lat
                + (steps - inter) * self.coll_step_lat_intra
                + inter * self.coll_step_lat_inter
            )
        step = self.coll_step_lat_inter if nodes > 1 else self.coll_step_lat_intra
        return self.coll_base_lat + step


PRESETS: dict[str, Cluster] = {
    # H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 900 GB/s bidirectional (≈ 360 GB/s achieved
    # all-to-all per GPU); 8 × 400 Gb/s InfiniBand NDR per node (50 GB/s per GPU, ≈ 40 achieved)
    "h100-nvlink-ib": Cluster(
        "h100-nvlink-ib", 989.0, 0.40, 360 * GB, 40 * GB, 10e-6, 20e-6, 8, 80
    ),
    # H800 SXM: the H100 die with NVLink cut to 400 GB/s bidirectional (≈ 160 GB/s achieved);
    # typically 8 × 400 Gb/s (some sites 200 Gb/s) InfiniBand
    "h800-nvlink-ib": Cluster(
        "h800-nvlink-ib", 989.0, 0.40, 160 * GB, 40 * GB, 10e-6, 20e-6, 8, 80
    ),
    # A100 SXM 80 GB: 312 TFLOP/s bf16; NVLink 3 600 GB/s bidirectional (≈ 230 achieved);
    # 8 × 200 Gb/s HDR per node (25 GB/s per GPU, ≈ 20 achieved)
    "a100-nvlink-ib": Cluster(
        "a100-nvlink-ib", 312.0, 0.45, 230 * GB, 20 * GB, 10e-6, 20e-6, 8, 80
    ),
    # Summit node: 6 × V100 16 GB (125 TFLOP/s fp16 tensor), NVLink 2 at 50 GB/s per direction
    # between the 3 GPUs of a socket (less across the X-bus); dual-rail EDR InfiniBand,
    # 25 GB/s per node = ≈ 4 GB/s per GPU
    "v100-summit": Cluster("v100-summit", 125.0, 0.30, 40 * GB, 3.5 * GB, 15e-6, 30e-6, 6, 16),
}

# The memory-bound and latency terms (docs/cost_model.md, "Constants"): device-memory
# bandwidth from the data sheets × STREAM_FRACTION, and NCCL's own latency model
# (NVIDIA/nccl src/graph/tuning.cc: baseLat Ring/Simple 8.4 µs; hwLat Ring/Simple
# NVLink 3.4 µs, network 14.0 µs per ring step).
STREAM_FRACTION = 0.8  # a streaming copy reaches ~80 % of the sheet's HBM bandwidth
NCCL_LATENCY = {
    "coll_base_lat": 8.4e-6,
    "coll_step_lat_intra": 3.4e-6,
    "coll_step_lat_inter": 14e-6,
}
DEVICE_TERMS: dict[str, dict] = {
    "h100-nvlink-ib": {"hbm_bw": 3350 * GB * STREAM_FRACTION},  # H100 SXM5 HBM3 3.35 TB/s
    "h800-nvlink-ib": {"hbm_bw": 3350 * GB * STREAM_FRACTION},  # H800 SXM5 HBM3 3.35 TB/s
    "a100-nvlink-ib": {"hbm_bw": 2039 * GB * STREAM_FRACTION},  # A100 SXM 80GB 2.04 TB/s
    # V100 SXM2 16 GB HBM2 900 GB/s; no fused attention kernel (FlashAttention needs
    # Turing/Ampere or later): the score matrix goes through HBM
    "v100-summit": {"hbm_bw": 900 * GB * STREAM_FRACTION, "fused_attention": False},
}
PRESETS = {k: c.with_(**NCCL_LATENCY, **DEVICE_TERMS[k]) for k, c in PRESETS.items()}


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "dspzoo" / "this-cpu.json"


def _probe_worker(rank: int, world: int) -> Rates:
    return probe_group()


def this_cpu(rates: Rates) -> Cluster:
    """The ``this-cpu`` cluster of measured :class:`~.probe.Rates` (one thread per rank).

    Its links are timed as a real ``switch`` (``Rates.switch_*``: the backend's all-to-all with
    the switch's layout copies) where measured, else as the backend's bare all-to-all (a cache
    from before that probe)."""
    switch = rates.switch_bandwidth > 0
    bandwidth = rates.switch_bandwidth if switch else rates.bandwidth
    latency = rates.switch_latency if switch else rates.latency
    return Cluster(
        name="this-cpu",
        peak_tflops=rates.flops / 1e12,
        mfu=1.0,  # the probe measures the achieved rate
        intra_bw=bandwidth,
        inter_bw=bandwidth,
        intra_lat=latency,
        inter_lat=latency,
        gpus_per_node=os.cpu_count() or 1,
        memory_gib=_memory_gib(),
        hbm_bw=rates.memory_bandwidth,  # the element-wise work and layout copies run at it
        attention_tflops=rates.attention_flops / 1e12,
        switch_bw=rates.switch_bandwidth,  # a switch's rate has its layout copies in it
        switch_lat=rates.switch_latency,
    )


_PROBE_KEYS = ("measured_at", "probe")  # what the cache file adds to a Cluster's fields


def cache_this_cpu(cluster: Cluster, rates: Rates) -> None:
    """Keep ``cluster`` as this machine's ``this-cpu`` (best effort, atomic), with when and how
    it was probed (ranks and threads of the group: a probe at SP 4 differs from one at SP 2).
    The attention rate is left out: it was measured at one workload's shape, not the machine's."""
    path = _cache_path()
    record = {
        **asdict(cluster.with_(attention_tflops=0.0)),
        "measured_at": time.time(),
        "probe": {"ranks": rates.ranks, "threads": rates.threads},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def cached_probe(path: Path | None = None) -> dict[str, Any] | None:
    """When and how the cached ``this-cpu`` was probed (``measured_at``, ``probe``), if known."""
    try:
        record = json.loads((path or _cache_path()).read_text())
    except (OSError, ValueError):
        return None
    return {k: record[k] for k in _PROBE_KEYS if k in record} or None


def this_cpu_note() -> str:
    """One line saying where the cached ``this-cpu`` figures come from."""
    info = cached_probe()
    if info is None or "measured_at" not in info:
        return "this-cpu: measured now or by an older probe (no record of when)"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(info["measured_at"]))
    probe = info.get("probe", {})
    how = (
        f" on {probe['ranks']} ranks × {probe['threads']} thread(s)"
        if {"ranks", "threads"} <= set(probe)
        else ""
    )
    return (
        f"this-cpu: probed {when}{how}; a `dspzoo bench` run or "
        "measure_this_cpu(refresh=True) probes again"
    )


def measure_this_cpu(refresh: bool = False) -> Cluster:
    """This machine's ``this-cpu`` cluster: cached, else probed in a 2-process gloo group
    (:func:`~.probe.probe_group`). A benchmark probes its own group instead, in the same run."""
    path = _cache_path()
    if not refresh and path.exists():
        try:
            fields = json.loads(path.read_text())
            for key in _PROBE_KEYS:
                fields.pop(key, None)
            return Cluster(**fields)
        except (TypeError, ValueError):
            pass
    from ..testing import run_distributed

    results = run_distributed(_probe_worker, 2, timeout=120)
    cluster = this_cpu(results[0])
    cache_this_cpu(cluster, results[0])
    return cluster


def _memory_gib() -> float:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def get_cluster(name: str | Cluster) -> Cluster:
    """A preset by name (``"this-cpu"`` measures this machine, cached), or the cluster given."""
    if isinstance(name, Cluster):
        return name
    if name == "this-cpu":
        return measure_this_cpu()
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; presets: {[*PRESETS, 'this-cpu']}") from None


CLUSTERS = (*PRESETS, "this-cpu")

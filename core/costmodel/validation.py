"""The published figures the cost model is checked against, recomputed from the code.

Each :class:`Figure` is one published number (a time or a speed-up), its source, and the
workload, strategies and cluster that describe the experiment. :func:`validation_table`
predicts every figure twice — with the presets as they stand (*after*: the memory-bound,
layout-copy and NCCL-latency terms on) and with those terms off (*before*: the plain α-β
model the repository had) — and gives the residual ``predicted / published − 1`` of each.
Nothing here is fitted: the constants are the presets' (``cluster.py``, sources in
``docs/cost_model.md``). ``docs/cost_model.md`` prints this table; ``tests/test_costmodel.py``
recomputes it and checks the residuals the doc states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .cluster import Cluster, get_cluster
from .predict import predict
from .workload import Workload

__all__ = [
    "FIGURES",
    "Figure",
    "FigureRow",
    "format_validation",
    "plain_alpha_beta",
    "validation_table",
]


def plain_alpha_beta(cluster: Cluster) -> Cluster:
    """``cluster`` with the added terms off: the model as it was before them."""
    return cluster.with_(
        hbm_bw=0.0,
        coll_base_lat=0.0,
        coll_step_lat_intra=0.0,
        coll_step_lat_inter=0.0,
        fused_attention=True,
    )


@dataclass(frozen=True)
class Figure:
    """One published figure and how to predict it on a cluster."""

    name: str
    source: str
    published: float
    unit: str  # "s" or "x" (a ratio)
    predict: Callable[[Cluster], float]


@dataclass(frozen=True)
class FigureRow:
    figure: Figure
    before: float
    after: float

    @property
    def residual_before(self) -> float:
        return self.before / self.figure.published - 1

    @property
    def residual(self) -> float:
        return self.after / self.figure.published - 1


def _workload(name: str, **sizes) -> Workload:
    """The zoo model's workload (imported here: the cost model does not import the zoo)."""
    import dspzoo.domains.text  # noqa: F401  (registers the families)
    import dspzoo.domains.video  # noqa: F401
    from dspzoo.zoo.workloads import workload_for

    return workload_for(name, **sizes)


# -- OpenSora inference on 8 H800 (DSP's reference code) ----------------------------------------
OPENSORA_SOURCE = (
    "VideoSys (NUS-HPC-AI-Lab, DSP's reference code) docs/dsp.md: OpenSora, 80 frames "
    "512×512, latency 1×H800 106 s, 8×H800 DS-Ulysses 45 s, 8×H800 DSP 22 s"
)
OPENSORA_STEPS = 100  # sampling steps; classifier-free guidance doubles the batch
OPENSORA_LATENT = (64, 64)  # 512² px through the SD VAE (8×); the workload patches it (2 × 2)


def _opensora(strategy: str, n: int) -> Callable[[Cluster], float]:
    def run(cluster: Cluster) -> float:
        # OpenSora 1.0: SD VAE (8× spatial, no temporal compression), STDiT-XL/2 (patch 1×2×2):
        # 80 × (64/2)² = 80 × 1024 tokens; CFG batch 2; T5 context 120 tokens; bf16
        wl = _workload(
            "stdit-720M", frames=80, spatial=OPENSORA_LATENT, batch=2, context=120, itemsize=2
        )
        p = predict(wl, strategy, n, cluster, training=False, exact_ranks=False)
        return OPENSORA_STEPS * p.step_s

    return run


# -- DSP paper: training throughput DSP over Ulysses, H100 ---------------------------------------
DSP_SOURCE = (
    "Zhao et al., DSP: Dynamic Sequence Parallelism for Multi-Dimensional Transformers "
    "(ICML 2025, arXiv 2403.10266): end-to-end throughput over DeepSpeed-Ulysses on up to "
    "128 H100 (NVLink in a node, InfiniBand across), 720M and 3B, spatial 1024² px"
)
# weak scaling as the paper runs it: the temporal length grows with the GPUs (T = N), the
# spatial one is fixed (1024² px → SD VAE 8× → a 128 × 128 latent → patch 2 → 64 × 64 =
# 4096 tokens); SP = every GPU, up to the largest size Ulysses runs (heads ≥ N); training
# with recompute
DSP_LATENT = (128, 128)  # the latent H × W: the workload patches it (stdit patch 2)
DSP_GRID = tuple((m, n) for m in ("stdit-720M", "stdit-3B") for n in (8, 16))


def _dsp_gain(ulysses: str, pick: Callable[[list[float]], float]) -> Callable[[Cluster], float]:
    def run(cluster: Cluster) -> float:
        ratios = []
        for model, n in DSP_GRID:
            wl = _workload(model, frames=n, spatial=DSP_LATENT, batch=1, context=120, itemsize=2)
            kw = {"recompute": True, "exact_ranks": False}
            dsp = predict(wl, "dsp", n, cluster, **kw).step_s
            ratios.append(predict(wl, ulysses, n, cluster, **kw).step_s / dsp)
        return pick(ratios)

    return run


# -- LSS paper: LSS over Megatron-SP, 144 V100 (Summit) ------------------------------------------
LSS_SOURCE = (
    "Wang et al., Ultra-Long Sequence Distributed Transformer (arXiv 2311.02382): LSS 5.6× "
    "faster than NVIDIA's sequence parallelism (Megatron-SP) on 144 V100 (Summit), enwik8, "
    "12 layers, hidden 512, 8 heads"
)


def _lss_speedup(seq_len: int) -> Callable[[Cluster], float]:
    def run(cluster: Cluster) -> float:
        wl = _workload("bytelm-lss-12l", seq_len=seq_len, batch=1, itemsize=2)
        kw = {"exact_ranks": False}
        lss = predict(wl, "lss", 144, cluster, **kw).step_s
        return predict(wl, "megatron_sp", 144, cluster, **kw).step_s / lss

    return run


H100, H800, V100 = "h100-nvlink-ib", "h800-nvlink-ib", "v100-summit"
FIGURES: tuple[tuple[Figure, str], ...] = (
    (Figure("OpenSora 1 GPU, 100 steps", OPENSORA_SOURCE, 106.0, "s", _opensora("dsp", 1)), H800),
    (
        Figure("OpenSora 8 GPU Ulysses (8 a2a/layer)", OPENSORA_SOURCE, 45.0, "s",
               _opensora("ulysses_flat", 8)),
        H800,
    ),
    (Figure("OpenSora 8 GPU DSP", OPENSORA_SOURCE, 22.0, "s", _opensora("dsp", 8)), H800),
    (
        Figure("DSP paper: DSP/Ulysses(4), low end", DSP_SOURCE, 1.32, "x", _dsp_gain("ulysses", min)),
        H100,
    ),
    (
        Figure("DSP paper: DSP/Ulysses(4), high end", DSP_SOURCE, 1.75, "x", _dsp_gain("ulysses", max)),
        H100,
    ),
    (
        Figure("DSP paper: DSP/Ulysses(8), low end", DSP_SOURCE, 1.32, "x",
               _dsp_gain("ulysses_flat", min)),
        H100,
    ),
    (
        Figure("DSP paper: DSP/Ulysses(8), high end", DSP_SOURCE, 1.75, "x",
               _dsp_gain("ulysses_flat", max)),
        H100,
    ),
    (Figure("LSS/Megatron-SP, L 12,528", LSS_SOURCE, 5.6, "x", _lss_speedup(12528)), V100),
    (Figure("LSS/Megatron-SP, L 50,112", LSS_SOURCE, 5.6, "x", _lss_speedup(50112)), V100),
)  # fmt: skip


def validation_table() -> list[FigureRow]:
    """Every figure predicted with the added terms off (before) and on (after)."""
    rows = []
    for figure, cluster in FIGURES:
        cl = get_cluster(cluster)
        rows.append(FigureRow(figure, figure.predict(plain_alpha_beta(cl)), figure.predict(cl)))
    return rows


def format_validation(rows: list[FigureRow]) -> str:
    """The markdown table of ``docs/cost_model.md``."""
    lines = [
        "| figure | published | predicted before | predicted after | residual before | residual after |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r.figure
        fmt = (lambda x: f"{x:.1f} s") if f.unit == "s" else (lambda x: f"{x:.2f}×")
        lines.append(
            f"| {f.name} | {fmt(f.published)} | {fmt(r.before)} | {fmt(r.after)} | "
            f"{r.residual_before:+.0%} | {r.residual:+.0%} |"
        )
    return "\n".join(lines)

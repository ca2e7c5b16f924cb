"""Benchmark, the one measuring tool: every sequence-parallel strategy (and DeepSpeed-Ulysses,
when installed) on the same model, weights and inputs; interleaved timed steps with ratios to
DSP, traced bytes beside the cost model's formula, activation memory, and the output and every
gradient against one process. ``scripts/benchmark.py`` / ``dspzoo bench``; see
``docs/benchmark.md``."""

from .case import Case, build_case, not_runnable, select_strategies
from .meshes import MeshCache
from .runner import MODES, PEER, STRATEGIES, build_parser, main, run

__all__ = [
    "MODES",
    "PEER",
    "STRATEGIES",
    "Case",
    "MeshCache",
    "build_case",
    "build_parser",
    "main",
    "not_runnable",
    "run",
    "select_strategies",
]

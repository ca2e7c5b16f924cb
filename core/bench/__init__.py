"""Benchmark: every sequence-parallel strategy (and DeepSpeed-Ulysses, when installed) on the
same model, weights and inputs; interleaved timed steps, traced bytes beside the cost model,
activation memory, agreement with DSP. ``scripts/benchmark.py`` / ``dspzoo bench``; see
``docs/benchmark.md``."""

from .runner import MODES, PEER, STRATEGIES, build_parser, main, run

__all__ = ["MODES", "PEER", "STRATEGIES", "build_parser", "main", "run"]

"""Sequence-parallel strategies, chosen at run time by name (``SeqParallel(mesh, strategy=…)``).

A strategy is a planning policy; the runtime executes any plan the same way.

=============  ============================================================================
``dsp``        switch the sharded dim between stages (hybrid: an embedded method only on
               stages that mix every dim)
``ulysses``    one dim sharded; attention over it: all-to-all to heads and back
``ring``       one dim sharded; attention over it: K/V blocks passed around a ring
``ring_zigzag``  ring with the dim cut in 2N chunks, rank r holding r and 2N−1−r (causal
               load balancing)
``ring_balanced``  ring on the contiguous layout, causal work balanced by computing each pair
               where its queries or its keys live (switches and scans stay possible)
``lss``        one dim sharded; attention over it: one fused all-gather of K and V
``lss_zigzag``  LSS with the dim cut in 2N chunks as ring_zigzag (causal load balancing)
``lss_balanced``  LSS on the contiguous layout, causal work balanced by lending query rows
               from the later rank of each pair to the earlier (switches and scans stay possible)
``usp``        one dim sharded; Ulysses inside ring groups (``build_mesh(ulysses_size=…)``)
``megatron_sp`` Megatron-LM tensor parallelism + sequence parallelism over the SP group:
               needs ``parallelize_megatron(model, group)`` (:mod:`dspzoo.core.parallel.methods.megatron`)
=============  ============================================================================
"""

from __future__ import annotations

from .auto import Auto
from .base import Strategy, local_attention
from .dsp import DSP
from .embedded import Embedded

# the one strategy list: name -> what it does (every comparison iterates over it; ``auto`` is
# built by name too but is not a fixed method to compare)
STRATEGIES: dict[str, str] = {
    "dsp": "Dynamic Sequence Parallelism (switch between stages; hybrid for all-dim stages)",
    "ulysses": "DeepSpeed-Ulysses (sequence ↔ head all-to-all around attention)",
    "ring": "Ring attention (K/V blocks around the ring, online softmax)",
    "ring_zigzag": "Ring attention on a zigzag layout (balanced causal work)",
    "ring_balanced": "Ring attention on the contiguous layout, causal work balanced by schedule",
    "lss": "Long-Short-Sequence distributed attention (one fused K/V all-gather)",
    "lss_zigzag": "LSS on a zigzag layout (balanced causal work)",
    "lss_balanced": "LSS on the contiguous layout, causal work balanced by lending query rows",
    "usp": "Unified SP: Ulysses inside, ring across (2-D SP sub-mesh)",
    "megatron_sp": "Megatron-LM tensor parallelism with sequence parallelism (heads/hidden sharded)",
}


def get_strategy(name: str, dim: str | None = None) -> Strategy:
    """Instantiate the strategy called ``name``; ``dim`` fixes an embedded strategy's dim."""
    if name == "auto":
        return Auto(dim)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; available: {sorted(STRATEGIES)}")
    if name == "dsp":
        if dim is not None:
            raise ValueError("the dsp strategy plans its sharded dims itself; do not pass dim")
        return DSP()
    return Embedded(name, dim)


__all__ = ["DSP", "STRATEGIES", "Auto", "Embedded", "Strategy", "get_strategy", "local_attention"]

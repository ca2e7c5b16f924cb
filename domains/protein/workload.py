"""``dspzoo plan`` for the Evoformer: its two-activation DSP plan, bytes per rank per SP size.

The cost model's :class:`~dspzoo.core.costmodel.Workload` describes one activation; the
Evoformer carries two (the MSA ``m[s, r]`` and the pair ``z[i, j]``) and runs under ``dsp``
only, planned by :func:`~.model.evoformer_plan` (docs/protein_model.md). This module sizes that
plan from the command line's residues and MSA depth and prints what it sends.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspzoo.core.parallel.trace import format_bytes

from ...core.errors import UsageError
from .model import EvoformerConfig, evoformer_plan

# AlphaFold 2's initial training crop: 256 residues, 128 MSA cluster rows
DEFAULT_RESIDUES = 256
DEFAULT_MSA_DEPTH = 128


def plan_table(
    name: str,
    config: EvoformerConfig,
    *,
    residues: int,
    msa_depth: int,
    sp_sizes: Sequence[int],
    batch: int = 1,
    itemsize: int = 2,
    training: bool = True,
) -> str:
    """Rows per SP size: switches per block, bytes per block and per trunk pass (``num_blocks``
    blocks) that rank 0 sends, forward and (``training``) backward; then the largest SP size's
    plan stage by stage. ``itemsize``: activation bytes (bf16: 2)."""
    if residues < 1 or msa_depth < 1:
        raise UsageError(
            f"--residues and --msa-depth must be positive, got {residues}, {msa_depth}"
        )
    blocks = config.num_blocks
    head = (
        f" SP  switches/block  fwd/block/rank  bwd/block/rank  per trunk pass/rank ({blocks} blocks"
        f"{', fwd + bwd' if training else ', fwd'})"
    )
    rows = [head, "-" * len(head)]
    plans = []
    for n in sp_sizes:
        plan = evoformer_plan(config, residues, msa_depth, n)
        plans.append(plan)
        fwd = plan.bytes_per_period(0, batch, itemsize, "forward")
        bwd = plan.bytes_per_period(0, batch, itemsize, "backward") if training else 0
        switches = plan.switches_per_period if n > 1 else 0  # one rank holds everything
        rows.append(
            f"{n:>3}  {switches:>14}  {format_bytes(fwd):>14}  "
            f"{format_bytes(bwd) if training else '-':>14}  {format_bytes(blocks * (fwd + bwd)):>19}"
        )
    widest = max(plans, key=lambda p: p.sp_size)
    return "\n".join(rows) + "\n\n" + widest.describe(batch, itemsize)

"""Dynamic Sequence Parallelism: switch the sharded dim between stages, attend locally."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Strategy

if TYPE_CHECKING:
    from ..runtime import SeqParallel, SeqTensor


class DSP(Strategy):
    """Before each stage, re-shard onto the dim the plan chose (one all-to-all if it changed).

    Every stage then mixes only whole, local dims: attention needs no communication at all.
    """

    name = "dsp"

    def to_stage(self, sp: SeqParallel, act: SeqTensor, stage: str) -> SeqTensor:
        if act.plan is None:
            raise ValueError(
                "to_stage: the activation has no plan; create it with sp.enter(..., stages=...)"
            )
        return sp.switch(act, act.plan.sharded_for(stage))

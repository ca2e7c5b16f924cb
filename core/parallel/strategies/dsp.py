"""Dynamic Sequence Parallelism: switch the sharded dim between stages, attend locally."""

from __future__ import annotations

from ..plan import Plan, Stage, plan_stages
from .base import Strategy


class DSP(Strategy):
    """Before each stage, re-shard onto a dim the stage does not mix (one all-to-all if it
    changed), so attention needs no communication; a stage that mixes *every* dim runs with
    the cheapest embedded method (a hybrid plan, see :func:`~dspzoo.core.parallel.plan.plan_stages`)."""

    name = "dsp"

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        return plan_stages(names, lengths, stages, sp_size)

"""``strategy="auto"``: the plan the cost model predicts to communicate least.

Not listed in :data:`dspzoo.core.strategies.STRATEGIES` (the fixed methods that comparisons
iterate over); :func:`dspzoo.core.strategies.get_strategy` builds it by name. See
:func:`dspzoo.core.costmodel.predict.auto_plan` for the rule.
"""

from __future__ import annotations

from ..plan import Plan, Stage
from ..strategies.base import Strategy


class Auto(Strategy):
    """Per stage, DSP's switch or an embedded method, whichever the cost model ranks cheapest."""

    name = "auto"

    def __init__(self, dim: str | None = None) -> None:
        if dim is not None:
            raise ValueError("the auto strategy chooses its sharded dims itself; do not pass dim")

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        from .predict import auto_plan

        return auto_plan(names, lengths, stages, sp_size)

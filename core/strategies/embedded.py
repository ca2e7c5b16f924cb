"""Embedded sequence parallelism: one dim sharded throughout, attention over it communicates."""

from __future__ import annotations

from ..plan import Plan, Stage, plan_fixed
from .base import Strategy


class Embedded(Strategy):
    """Shard one dim for the whole model and run every stage that mixes it with ``method``.

    Args:
        method: ``"ulysses"``, ``"ring"``, ``"lss"`` or ``"usp"``.
        dim: the sharded sequence dim (default: the longest).
        layout: ``"contiguous"``, or ``"zigzag"`` for ring (causal load balancing).
    """

    def __init__(self, method: str, dim: str | None = None, layout: str = "contiguous") -> None:
        self.name = method if layout == "contiguous" else f"{method}_{layout}"
        self.method = method
        self.dim = dim
        self.layout = layout

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        return plan_fixed(
            names, lengths, stages, sp_size, self.method, self.dim, layout=self.layout
        )

    def __repr__(self) -> str:
        return f"Embedded({self.method!r}, dim={self.dim!r}, layout={self.layout!r})"

"""Embedded sequence parallelism: one dim sharded throughout, stages over it use a method."""

from __future__ import annotations

from ..methods.registry import get_method
from ..plan import Plan, Stage, plan_fixed
from .base import Strategy


class Embedded(Strategy):
    """Shard one dim for the whole model and run every stage that mixes it with ``method``.

    A stage whose op kind the method cannot run (a convolution under Ring) gets its dims
    whole the DSP way instead (a switch), so the plan is exact for any stage list.

    Args:
        method: a registered method with an attention entry (``"ulysses"``, ``"ring"``,
            ``"ring_zigzag"``, ``"ring_balanced"``, ``"lss"``, ``"lss_zigzag"``,
            ``"lss_balanced"``, ``"usp"``, ``"megatron_sp"``).
        dim: the sharded sequence dim (default: the longest).
        layout: ``"contiguous"``, or ``"zigzag"`` for ring (the ``ring_zigzag`` method); a
            method registered with the zigzag layout (``ring_zigzag``, ``lss_zigzag``) uses it.
    """

    def __init__(self, method: str, dim: str | None = None, layout: str = "contiguous") -> None:
        if method == "ring" and layout == "zigzag":
            method = "ring_zigzag"
        registered = get_method(method)
        self.name = method
        self.method = method
        self.dim = dim
        self.layout = registered.layout

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
        return f"Embedded({self.name!r}, dim={self.dim!r})"

"""What a sequence-parallel strategy decides: the plan, stage preparation and attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layers.attention import attend
from ..layout import SeqSpec
from ..plan import Plan, Stage, plan_stages

if TYPE_CHECKING:
    from ..runtime import SeqParallel, SeqTensor


class Strategy:
    """Base strategy: plans with the DSP planner and attends locally over whole dims.

    Subclasses override :meth:`to_stage` (layout changes between stages) and/or
    :meth:`attention` (communication inside attention over a sharded dim).
    """

    name = "base"

    def plan(
        self,
        names: tuple[str, ...],
        lengths: tuple[int, ...],
        stages: tuple[Stage, ...],
        sp_size: int,
    ) -> Plan:
        return plan_stages(names, lengths, stages, sp_size)

    def to_stage(self, sp: SeqParallel, act: SeqTensor, stage: str) -> SeqTensor:
        raise NotImplementedError

    def attention(
        self,
        sp: SeqParallel,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: SeqSpec,
        over: str,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        if spec.sharded == over and sp.size > 1:
            raise RuntimeError(
                f"{self.name}: attention over {over!r} while {over!r} is sharded; call sp.to_stage() for "
                f"this stage first, or declare that the stage mixes {over!r}"
            )
        return local_attention(q, k, v, spec, over, mask, causal)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: SeqSpec,
    over: str,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention along the whole local dim ``over`` of ``[B, *seq, H, D]`` tensors.

    The other sequence dims (and the batch) fold into the attention batch. ``mask`` is
    boolean and broadcastable to ``[batch', H, L, L]``.
    """
    axis = spec.axis(over)
    if q.dim() != spec.first_axis + len(spec.names) + 2:
        raise ValueError(
            f"attention expects [B, *{spec.names}, heads, head_dim] tensors, got shape {tuple(q.shape)}"
        )

    def fold(t: torch.Tensor) -> torch.Tensor:
        t = t.movedim(axis, -3)
        return t.reshape(-1, *t.shape[-3:])

    out = attend(fold(q), fold(k), fold(v), mask=mask, causal=causal)
    moved = q.movedim(axis, -3).shape
    return out.reshape(moved).movedim(-3, axis)

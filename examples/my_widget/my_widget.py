"""A model family of your own, registered from outside dspzoo (docs/new_architecture.md,
"Registering your family outside dspzoo").

Nothing in dspzoo imports this module: name it in ``DSPZOO_FAMILIES`` with its folder on
``PYTHONPATH`` and every dspzoo entry point sees the family::

    PYTHONPATH=examples/my_widget DSPZOO_FAMILIES=my_widget dspzoo list
    PYTHONPATH=examples/my_widget DSPZOO_FAMILIES=my_widget dspzoo info widget-mini
    PYTHONPATH=examples/my_widget DSPZOO_FAMILIES=my_widget dspzoo plan widget-mini --dims h=64,w=64

The model is a stack of token-wise linear layers on an image of ``width`` channels per pixel,
``(B, H, W, width) → (B, H, W, width)``: small enough to read at a glance; a real family
registers the same four lines (``examples/axial3d.py`` is a complete one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspzoo.core.costmodel import StageSpec, Workload
from dspzoo.core.costmodel.workload import register_workload
from dspzoo.core.parallel.plan import Stage
from dspzoo.zoo import register_config, register_family

#: the token dims, in layout order
SEQ_DIMS = ("h", "w")
#: one layer: a token-wise linear map (it mixes no sequence dim, so every stage runs locally)
STAGES = (Stage("linear"),)


@dataclass(frozen=True)
class WidgetConfig:
    """``width`` channels per pixel, ``depth`` linear layers."""

    width: int = 8
    depth: int = 2


class Widget(nn.Module):
    """``depth`` linear layers of ``width → width`` applied to every pixel."""

    def __init__(self, config: WidgetConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.Sequential(
            *(nn.Linear(config.width, config.width) for _ in range(config.depth))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, width) → (B, H, W, width)."""
        return self.layers(x)


def workload(
    name: str,
    config: WidgetConfig,
    *,
    spatial: int | tuple[int, int] | None = None,
    batch: int = 1,
    itemsize: int = 4,
    params: int = 0,
    **_: object,
) -> Workload:
    """The cost model's view of one step on an image of ``spatial`` (H or (H, W)) pixels, for
    ``dspzoo plan``. Each layer is one token-wise stage; counted as an MLP of hidden
    ``width // 2`` (``width → width // 2 → width``: the FLOPs of one ``width → width`` linear)."""
    if spatial is None:
        raise ValueError(f"{name} needs --size (pixels) or --dims h=...,w=...")
    h, w = (spatial, spatial) if isinstance(spatial, int) else spatial
    layer = (StageSpec(STAGES[0], mlp=True, adaln=False),)
    return Workload(name, "widget", batch, SEQ_DIMS, (h, w), config.width, 1, 1,
                    max(1, config.width // 2), (layer,) * config.depth, STAGES, config.width,
                    config.width, params=params, itemsize=itemsize)  # fmt: skip


register_family("widget", Widget, WidgetConfig)
register_config("widget", "mini", WidgetConfig())
register_config("widget", "wide", WidgetConfig(width=64))
register_workload("widget", workload)

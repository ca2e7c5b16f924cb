"""Scan stages: a Mamba mixer run over a grid of tokens in a :mod:`.orders` scan order.

:func:`scan_stage` declares the stage (the dims it mixes, op kind ``scan`` for axial and raster
orders: a stage whose scanned dims are whole runs locally, DSP's axial case; one whose outermost
scanned dim is sharded runs a scan method). :func:`run_scan` is the one place a mixer meets the
grid; it calls ``sp.scan`` (the scan op kind's runtime entry: state passing, head all-to-all over
a sharded scanned dim).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dspzoo.core.layers.mamba import Mamba1Config, Mamba1Mixer, Mamba2Config, Mamba2Mixer
from dspzoo.core.parallel import context
from dspzoo.core.parallel.plan import Stage

from .orders import ScanOrder, along_route, fold, from_route, parse_order, unfold

#: The op kind of a segmentable scan stage: local where its dims are whole (DSP's axial order),
#: a scan method (state passing, head all-to-all) through ``sp.scan`` where one is sharded.
SCAN_OP = "scan"


def scan_stage(name: str, order: str | ScanOrder, segmentable: bool = True) -> Stage:
    """The :class:`Stage` of a scan in ``order``: it mixes the order's dims.

    Only ``axial`` and ``raster`` scans of a ``segmentable`` op (one sequence read in order, so
    a shard of its outermost dim is a segment) get op kind :data:`SCAN_OP`; ``cross`` and
    ``zigzag`` routes, and circular scans (``segmentable=False``), need their dims whole:
    ``generic``.
    """
    order = parse_order(order)
    in_order = segmentable and order.kind in ("axial", "raster")
    return Stage(name, order.mixes, op=SCAN_OP if in_order else "generic")


def run_scan(
    mixer: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    grid_dims: tuple[str, ...],
    over: tuple[str, ...],
    sp=None,
    spec=None,
) -> torch.Tensor:
    """``mixer`` (``[B', L, C]`` → ``[B', L, C']``) over ``x`` ``[B, *grid_local, C]``: the
    ``over`` dims flattened (the first outermost) into the scanned sequence, the other dims in
    the batch. Returns ``[B, *grid_local, C']``.

    The one place a scan meets the parallel layer: the runtime's ``sp.scan`` — ``sp``/``spec``
    for blocks on the explicit API, the open region's runtime and layout for blocks on plain
    tensors — which runs locally when the scanned dims are whole and with the stage's scan
    method when one is sharded. Outside any region the grid is whole and the fold is local.

    Over a sharded scanned dim the scan methods call ``mixer.forward_segment`` /
    ``mixer.forward_heads`` (a Mamba mixer, :class:`~dspzoo.core.parallel.methods.scan.ScanOp`);
    a plain function (a route permutation around a mixer, a circular scan) can only run on a
    ``generic`` stage, whose dims are whole. ``B'`` may be 0 (a rank with an empty shard of a
    batch-folded dim): the mixers take an empty batch.
    """
    if sp is not None and spec is not None:
        return sp.scan(mixer, x, spec, over)
    if context.active() is not None:
        return context.runtime().scan(mixer, x, context.layout(), over)
    seq, sizes = fold(x, grid_dims, over)
    return unfold(mixer(seq), grid_dims, over, sizes)


def build_mixer(kind: str, hidden: int, **options) -> nn.Module:
    """A ``mamba1`` or ``mamba2`` mixer of width ``hidden`` (``options``: its config fields)."""
    if kind == "mamba1":
        return Mamba1Mixer(Mamba1Config(hidden_size=hidden, **options))
    if kind == "mamba2":
        return Mamba2Mixer(Mamba2Config(hidden_size=hidden, **options))
    raise ValueError(f"mixer must be 'mamba1' or 'mamba2', got {kind!r}")


class OrderedScan(nn.Module):
    """One scan of a grid in a scan order: ``[B, *grid, C]`` → ``[B, *grid, C]``.

    One mixer per route of the order (four for ``cross``, whose outputs are averaged, as
    VMamba's cross-merge sums them); ``layer`` picks ``zigzag``'s scheme.
    """

    def __init__(
        self,
        order: str | ScanOrder,
        grid_dims: tuple[str, ...],
        make_mixer: Callable[[], nn.Module],
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.order = parse_order(order, grid_dims)
        self.grid_dims, self.layer = tuple(grid_dims), layer
        self.mixers = nn.ModuleList(make_mixer() for _ in range(self.order.route_count()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, *grid_local, C]`` with the order's dims whole → same shape."""
        over = self.order.dims
        lengths = tuple(x.shape[1 + self.grid_dims.index(d)] for d in over)
        routes = self.order.routes(lengths, self.layer)
        outs = [
            run_scan(_along(mixer, perm), x, self.grid_dims, over)
            for mixer, perm in zip(self.mixers, routes, strict=True)
        ]
        return outs[0] if len(outs) == 1 else torch.stack(outs).mean(0)


def _along(mixer: nn.Module, perm: torch.Tensor | None) -> Callable:
    """``mixer`` read along route ``perm``: the mixer itself for the identity route (so a scan
    method can run it over a sharded dim), else a function of ``[B', L, C]`` that permutes the
    sequence in and its outputs back (``generic`` stages only: the route needs the dims whole)."""
    if perm is None:
        return mixer
    return lambda seq: from_route(mixer(along_route(seq, perm)), perm)

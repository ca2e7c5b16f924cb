"""Scan orders (domains/mamba/orders.py): parsing, permutations and inverses, folding, routes."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from dspzoo.domains.mamba.layers import OrderedScan
from dspzoo.domains.mamba.orders import (
    ScanOrder,
    along_route,
    fold,
    from_route,
    inverse_permutation,
    parse_order,
    transpose_permutation,
    unfold,
    zigzag_permutation,
    zigzag_schemes,
)

DIMS = ("t", "h", "w")


def grid(*shape: int, channels: int = 2) -> torch.Tensor:
    return torch.randn(2, *shape, channels, generator=torch.Generator().manual_seed(0))


def test_parse_orders():
    assert parse_order("axial(t)") == ScanOrder("axial", ("t",))
    assert parse_order(" raster( t, h ,w ) ", DIMS) == ScanOrder("raster", DIMS)
    assert str(parse_order("cross(h,w)")) == "cross(h,w)"
    assert parse_order("zigzag(h,w)").mixes == ("h", "w")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("spiral(h,w)", "is not one of axial"),
        ("axial", "is not one of axial"),
        ("axial(t,h)", "axial scans one dim"),
        ("cross(t,h,w)", "exactly two dims"),
        ("raster(h,h)", "distinct dim names"),
        ("axial(z)", "names dim(s) ['z'] the model does not have"),
    ],
)
def test_bad_orders_are_refused(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_order(spec, DIMS)


def test_inverse_permutation():
    perm = torch.randperm(23, generator=torch.Generator().manual_seed(3))
    inv = inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(23))
    assert torch.equal(inv[perm], torch.arange(23))
    seq = torch.randn(2, 23, 3)
    assert torch.equal(from_route(along_route(seq, perm), perm), seq)


def test_fold_axial_is_one_line_per_row():
    x = grid(3, 4, 5)
    seq, sizes = fold(x, DIMS, ("h",))
    assert seq.shape == (2 * 3 * 5, 4, 2)
    # line (b=1, t=2, w=3) is x[1, 2, :, 3]
    assert torch.equal(seq[(1 * 3 + 2) * 5 + 3], x[1, 2, :, 3])
    assert torch.equal(unfold(seq, DIMS, ("h",), sizes), x)


def test_fold_raster_is_flattening_slowest_first():
    x = grid(3, 4, 5)
    seq, sizes = fold(x, DIMS, DIMS)
    assert torch.equal(seq, x.flatten(1, 3))
    seq_wt, sizes = fold(x, DIMS, ("w", "t"))  # w outermost, h joins the batch
    assert torch.equal(seq_wt[1 * 4 + 1], x[1, :, 1].transpose(0, 1).reshape(15, 2))
    assert torch.equal(unfold(seq_wt, DIMS, ("w", "t"), sizes), x)


def test_cross_routes():
    a, b = 3, 4
    order = parse_order("cross(h,w)")
    routes = order.routes((a, b))
    assert routes[0] is None and len(routes) == 4
    plane = torch.arange(a * b).reshape(a, b)
    assert torch.equal(routes[1], plane.T.flatten())  # columns: w outermost
    assert torch.equal(routes[2], plane.flatten().flip(0))
    assert torch.equal(routes[3], plane.T.flatten().flip(0))
    assert torch.equal(
        transpose_permutation(a, b)[inverse_permutation(routes[1])], torch.arange(12)
    )


def _coords(perm: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.stack(torch.unravel_index(perm, lengths), -1)


@pytest.mark.parametrize("lengths", [(3, 4), (4, 3), (2, 3, 4), (5, 1), (1, 6), (3, 3, 3)])
def test_zigzag_paths_are_continuous_permutations(lengths):
    schemes = zigzag_schemes(len(lengths))
    assert len(schemes) == {2: 8, 3: 48}[len(lengths)]
    seen = set()
    for order, flips in schemes:
        perm = zigzag_permutation(lengths, order, flips)
        assert torch.equal(perm.sort().values, torch.arange(perm.numel()))
        steps = (_coords(perm, lengths)[1:] - _coords(perm, lengths)[:-1]).abs().sum(-1)
        assert torch.all(steps == 1), (order, flips, perm)
        start = _coords(perm, lengths)[0]
        assert all(int(c) in (0, n - 1) for c, n in zip(start, lengths, strict=True))  # a corner
        seen.add(tuple(perm.tolist()))
    if all(n > 1 for n in lengths):
        assert len(seen) == len(schemes)  # every scheme is its own path


def test_zigzag_rows_snake():
    perm = zigzag_permutation((3, 4))
    assert perm.tolist() == [0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11]


def test_layer_picks_zigzag_scheme():
    order = parse_order("zigzag(h,w)")
    first, second = order.routes((3, 4), layer=0)[0], order.routes((3, 4), layer=1)[0]
    assert not torch.equal(first, second)
    assert torch.equal(order.routes((3, 4), layer=8)[0], first)


class CumSum(torch.nn.Module):
    """A causal toy mixer: output k is the sum of inputs 0..k of its sequence (times a weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.weight * seq.cumsum(1)


def route_sum(x: torch.Tensor, order: ScanOrder, b: int, cell: dict[str, int], layer: int):
    """The mean over routes of the prefix sum of ``x`` along the route, up to ``cell``."""
    lengths = tuple(x.shape[1 + DIMS.index(d)] for d in order.dims)
    routes = order.routes(lengths, layer)
    pos = torch.tensor(0)
    for d, n in zip(order.dims, lengths, strict=True):  # row-major position in the order's dims
        pos = pos * n + cell[d]
    total = 0.0
    for perm in routes:
        walk = torch.arange(pos.new_tensor(lengths).prod()) if perm is None else perm
        k = int((walk == pos).nonzero())
        for j in range(k + 1):
            coords = torch.unravel_index(walk[j], lengths)
            at = dict(cell, **{d: int(c) for d, c in zip(order.dims, coords, strict=True)})
            total += float(x[b, at["t"], at["h"], at["w"], 0])
    return total / len(routes)


@pytest.mark.parametrize("spec", ["axial(h)", "raster(t,h,w)", "cross(h,w)", "zigzag(h,w)"])
def test_ordered_scan_follows_its_routes(spec):
    """Each output is the prefix sum of its route up to it, checked by walking the route."""
    x = grid(2, 3, 4, channels=1)
    scan = OrderedScan(spec, DIMS, CumSum, layer=3)
    want = torch.zeros_like(x)
    for b, t, h, w in itertools.product(range(2), range(2), range(3), range(4)):
        want[b, t, h, w, 0] = route_sum(x, scan.order, b, {"t": t, "h": h, "w": w}, 3)
    torch.testing.assert_close(scan(x), want)


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_empty_local_shard_scans_to_an_empty_output(mixer):
    """More ranks than rows of a batch-folded dim leave a rank with an empty shard."""
    from dspzoo.domains.mamba.layers import build_mixer

    options = {"state_size": 4} | ({"num_heads": 4, "head_dim": 8} if mixer == "mamba2" else {})
    scan = OrderedScan("axial(t)", DIMS, lambda: build_mixer(mixer, 16, **options))
    x = torch.randn(2, 5, 0, 3, 16, requires_grad=True)
    out = scan(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in scan.parameters())
    seq, sizes = fold(torch.zeros(2, 0, 4, 3, 1), DIMS, ("h",))
    assert seq.shape == (0, 4, 1) and unfold(seq, DIMS, ("h",), sizes).shape == (2, 0, 4, 3, 1)

"""Scan orders over a grid of tokens: which 1-D sequences a selective scan walks.

A multi-dimensional Mamba turns a grid ``[B, *grid, C]`` (named dims, e.g. ``t, h, w``) into
1-D sequences ``[B', L, C]``, scans them and puts the outputs back. An order, named in a config
as a string, says how:

* ``axial(d)`` — one scan per line along dim ``d``; every other dim joins the batch. The
  DSP-native order: the scanned dim is whole and any other dim may be sharded.
* ``raster(d1,d2,...)`` — the listed dims flattened into one sequence, the first slowest
  (outermost), as Vim / VideoMamba scan; dims not listed join the batch.
  ``axial(d)`` is ``raster(d)``.
* ``cross(a,b)`` — VMamba's four routes over the ``(a, b)`` plane: rows (``a`` outermost),
  columns (``b`` outermost), and both reversed.
* ``zigzag(d1,d2,...)`` — ZigMa's continuous paths: a snake (boustrophedon) through the listed
  dims, so consecutive tokens are grid neighbours; layer ``k`` takes scheme ``k mod S`` of the
  ``S = n!·2ⁿ`` schemes (dim orders × starting corners) of ``n`` dims (8 in 2-D).

A route is a permutation ``perm`` of the flattened (row-major, listed-dims order) positions:
the scanned sequence is ``seq[:, k] = flat[:, perm[k]]`` and the inverse puts position ``k``
back with ``inverse_permutation(perm)``. Everything here is a pure function of shapes; the
folding is einops.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import lru_cache

import torch
from einops import rearrange

KINDS = ("axial", "raster", "cross", "zigzag")
_BATCH = "batch"  # the einops name of the batch axis in fold/unfold
_SPEC = re.compile(r"^\s*(axial|raster|cross|zigzag)\s*\(\s*([a-z_][\w\s,]*)\)\s*$")


@dataclass(frozen=True)
class ScanOrder:
    """A parsed order: its ``kind`` (one of :data:`KINDS`) and the ``dims`` it scans, in order."""

    kind: str
    dims: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind}({','.join(self.dims)})"

    @property
    def mixes(self) -> tuple[str, ...]:
        """The dims a stage running this order mixes (what its ``Stage`` declares)."""
        return self.dims

    def route_count(self) -> int:
        """How many sequences each grid cell is scanned in (per layer): 4 for ``cross``, else 1."""
        return 4 if self.kind == "cross" else 1

    def routes(self, lengths: tuple[int, ...], layer: int = 0) -> list[torch.Tensor | None]:
        """The routes over the flattened ``dims`` of lengths ``lengths`` (one per dim, in
        ``dims`` order): a permutation ``[L]`` each, ``None`` for the identity (raster order).
        """
        if len(lengths) != len(self.dims):
            raise ValueError(f"{self}: got {len(lengths)} lengths {lengths} for dims {self.dims}")
        if self.kind in ("axial", "raster"):
            return [None]
        if self.kind == "cross":
            a, b = lengths
            cols = transpose_permutation(a, b)
            return [None, cols, reverse_permutation(a * b), cols.flip(0)]
        schemes = zigzag_schemes(len(lengths))
        dim_order, flips = schemes[layer % len(schemes)]
        return [zigzag_permutation(tuple(lengths), dim_order, flips)]


def parse_order(spec: str | ScanOrder, grid_dims: tuple[str, ...] | None = None) -> ScanOrder:
    """``"axial(t)"``, ``"raster(t,h,w)"``, ``"cross(h,w)"``, ``"zigzag(h,w)"`` → :class:`ScanOrder`.

    With ``grid_dims``, every named dim must be one of them (a clear error otherwise).
    """
    if isinstance(spec, ScanOrder):
        order = spec
    else:
        match = _SPEC.match(spec) if isinstance(spec, str) else None
        if match is None:
            raise ValueError(
                f"scan order {spec!r} is not one of axial(d), raster(d1,d2,...), cross(a,b), "
                f"zigzag(d1,d2,...) with dim names, e.g. 'axial(t)' or 'cross(h,w)'"
            )
        dims = tuple(d.strip() for d in match.group(2).split(",") if d.strip())
        order = ScanOrder(match.group(1), dims)
    if not order.dims or len(set(order.dims)) != len(order.dims):
        raise ValueError(f"scan order {order}: give distinct dim names")
    if order.kind == "axial" and len(order.dims) != 1:
        raise ValueError(f"scan order {order}: axial scans one dim; use raster(...) for several")
    if order.kind == "cross" and len(order.dims) != 2:
        raise ValueError(f"scan order {order}: cross scans a plane of exactly two dims")
    if grid_dims is not None:
        unknown = [d for d in order.dims if d not in grid_dims]
        if unknown:
            raise ValueError(
                f"scan order {order} names dim(s) {unknown} the model does not have; its dims "
                f"are {list(grid_dims)}"
            )
    return order


# ---------------------------------------------------------------------------------------------
# permutations
# ---------------------------------------------------------------------------------------------


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[k]] = k``: ``seq[:, inv]`` undoes ``flat[:, perm]``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def reverse_permutation(length: int) -> torch.Tensor:
    """The route that walks a sequence of ``length`` backwards."""
    return torch.arange(length - 1, -1, -1)


@lru_cache(maxsize=64)
def transpose_permutation(a: int, b: int) -> torch.Tensor:
    """Column-major route over an ``a × b`` row-major plane (``b`` outermost)."""
    return rearrange(torch.arange(a * b), "(a b) -> (b a)", a=a, b=b)


def zigzag_schemes(ndim: int) -> list[tuple[tuple[int, ...], tuple[bool, ...]]]:
    """ZigMa's schemes for ``ndim`` dims: every (dim order, flip per dim) pair, in a fixed order.

    ``ndim = 2`` gives 8: the snake along rows or along columns, from each of the 4 corners.
    """
    return [
        (order, flips)
        for order in itertools.permutations(range(ndim))
        for flips in itertools.product((False, True), repeat=ndim)
    ]


@lru_cache(maxsize=256)
def zigzag_permutation(
    lengths: tuple[int, ...], dim_order: tuple[int, ...] | None = None,
    flips: tuple[bool, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """A continuous snake through a row-major grid of ``lengths``.

    ``dim_order`` lists the dims from the outermost of the walk (default: as given); ``flips``
    starts a dim from its far end. Built recursively: the walk over the outer dim visits, for
    each of its values, the snake over the inner dims, reversed at every odd value, so two
    consecutive positions always differ by one step along one dim.
    """
    ndim = len(lengths)
    dim_order = tuple(range(ndim)) if dim_order is None else tuple(dim_order)
    flips = (False,) * ndim if flips is None else tuple(flips)
    if sorted(dim_order) != list(range(ndim)) or len(flips) != ndim:
        raise ValueError(f"zigzag over {ndim} dims: bad dim order {dim_order} / flips {flips}")
    index = torch.arange(int(torch.tensor(lengths).prod())).reshape(lengths)
    for d, flip in enumerate(flips):
        if flip:
            index = index.flip(d)
    index = index.permute(dim_order)  # the walk's outermost dim first
    # snake: from the innermost pair outwards, reverse the inner block at every odd outer value
    for d in range(index.dim() - 2, -1, -1):
        inner = tuple(range(d + 1, index.dim()))
        odd = torch.zeros(index.shape[d], dtype=torch.bool)
        odd[1::2] = True
        shape = [1] * index.dim()
        shape[d] = -1
        snaked = _reverse_lexicographic(index, inner)
        index = torch.where(odd.reshape(shape), snaked, index)
    return index.flatten()


def _reverse_lexicographic(index: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``index`` with the block over ``dims`` read backwards in row-major order."""
    lead = index.dim() - len(dims)
    flat = index.flatten(lead)
    return flat.flip(-1).reshape(index.shape)


# ---------------------------------------------------------------------------------------------
# folding a grid into sequences and back
# ---------------------------------------------------------------------------------------------


def fold(
    x: torch.Tensor, grid_dims: tuple[str, ...], over: tuple[str, ...]
) -> tuple[torch.Tensor, dict[str, int]]:
    """``x`` ``[B, *grid, C]`` → ``[B·(other dims), L, C]``, ``L`` the product of ``over``'s
    lengths flattened in ``over``'s order (the first outermost); also returns the batch's and
    every dim's length, for :func:`unfold` (which then also handles an empty local shard)."""
    if x.dim() != len(grid_dims) + 2:
        raise ValueError(
            f"expected [B, {', '.join(grid_dims)}, C] ({len(grid_dims) + 2} dims), "
            f"got shape {tuple(x.shape)}"
        )
    if _BATCH in grid_dims:
        raise ValueError(f"a grid dim may not be called {_BATCH!r}")
    sizes = dict(zip(grid_dims, x.shape[1:-1], strict=True), **{_BATCH: x.shape[0]})
    rest = [d for d in grid_dims if d not in over]
    pattern = (
        f"{_BATCH} {' '.join(grid_dims)} c -> ({_BATCH} {' '.join(rest)}) ({' '.join(over)}) c"
    )
    return rearrange(x, pattern), sizes


def unfold(
    seq: torch.Tensor, grid_dims: tuple[str, ...], over: tuple[str, ...], sizes: dict[str, int]
) -> torch.Tensor:
    """Inverse of :func:`fold`: ``[B·(other dims), L, C']`` → ``[B, *grid, C']``."""
    rest = [d for d in grid_dims if d not in over]
    pattern = (
        f"({_BATCH} {' '.join(rest)}) ({' '.join(over)}) c -> {_BATCH} {' '.join(grid_dims)} c"
    )
    if seq.numel() == 0:  # an empty shard: einops cannot infer lengths from a zero-size axis
        shape = [sizes[_BATCH], *(sizes[d] for d in grid_dims), seq.shape[-1]]
        return seq.reshape(shape)
    return rearrange(seq, pattern, **{d: sizes[d] for d in (_BATCH, *grid_dims)})


def along_route(seq: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """``seq`` ``[B', L, C]`` read along route ``perm`` (``None``: as it is)."""
    return seq if perm is None else seq.index_select(1, perm.to(seq.device))


def from_route(seq: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`along_route`: outputs back at the positions they were read from."""
    return seq if perm is None else seq.index_select(1, inverse_permutation(perm).to(seq.device))

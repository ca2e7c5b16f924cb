"""Selective scans (Mamba) over a sharded sequence dim: state passing and the head all-to-all.

A scan stage (op kind ``"scan"``) mixes its dims *in order*: the state at a token depends on
every earlier token. Three ways run it over the SP group:

* **DSP axial** (methods ``switch`` + ``local``): the scanned dim is whole, another is sharded;
  the mixer runs on its local lines with no communication inside it.
* **State passing** (``state_passing``): each rank holds one contiguous segment of the scanned
  sequence. Its conv gets the ``K−1`` inputs before the segment from its neighbour by p2p (the
  *halo*; more hops only when segments are shorter than ``K−1``); it scans its segment from zero
  state and summarises it as ``(decay, contribution)``; the summaries of all segments travel in
  **one** all-gather (backward: one reduce-scatter); an exclusive scan over the segments gives
  each rank its incoming state, and a closed-form correction adds what that state contributes
  to the segment's outputs. Exact forward and backward; the bytes do not grow with the length.
* **Head all-to-all** (``head_a2a``, Megatron-Core's Mamba context parallelism): after the conv
  (with its halo), the scan's per-channel inputs go from sequence shards to head (channel)
  shards by one all-to-all, the input-dependent ``B``/``C`` are gathered for local use, each
  rank scans the whole sequence for its heads, and one all-to-all brings the output back.

The mixer (``Mamba1Mixer``, ``Mamba2Mixer`` in :mod:`dspzoo.core.layers.mamba`, or any module
with the same three calls, :class:`ScanOp`) owns the arithmetic; this module owns the
communication, handed to the mixer as a *link*: :class:`SegmentLink` (halo, summaries) or
:class:`HeadLink` (halo, to/from heads, gather). Every collective goes through
:mod:`dspzoo.core.parallel.comm` (agreement first, so a bad shard on one rank raises on every rank).

Shapes: the runtime folds the activation ``[B, *seq, C]`` into ``[B', L_local, C]`` lines (the
scanned dims flattened, the sharded dim outermost; the other dims join the batch ``B'``).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd.function import once_differentiable

from .. import comm
from ..comm.agreement import Signature, agree
from ..comm.replicate import all_gather_along, reduce_scatter_along
from ..layout import SeqSpec, shard_sizes
from ..trace import current_region

if TYPE_CHECKING:
    from ..runtime import SeqParallel


class ScanOp(Protocol):
    """What a scan module offers the methods (``[B', L, C]`` in and out, channels last)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """One process: the whole sequence."""

    def forward_segment(self, x: torch.Tensor, link: SegmentLink) -> torch.Tensor:
        """State passing: ``x`` is this rank's segment ``[B', L_r, C]``."""

    def forward_heads(self, x: torch.Tensor, link: HeadLink) -> torch.Tensor:
        """Head all-to-all: ``x`` is this rank's segment ``[B', L_r, C]``."""


# -- folding the scanned dims -----------------------------------------------------------------
def fold_scan_dims(
    x: torch.Tensor, spec: SeqSpec, over: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Size]:
    """``[*lead, *seq, C]`` → ``[lead·others, L_over, C]`` and the permuted shape.

    The ``over`` dims are flattened in the order given (the first outermost: the scan order of a
    raster over them); the other sequence dims join the batch.
    """
    first, count = spec.first_axis, len(spec.names)
    if x.dim() != first + count + 1:
        raise ValueError(
            f"a scan expects [B, *{spec.names}, channels] tensors, got shape {tuple(x.shape)}"
        )
    over_axes = [spec.axis(d) for d in over]
    others = [first + i for i, n in enumerate(spec.names) if n not in over]
    moved = x.permute([*range(first), *others, *over_axes, x.dim() - 1])
    lines = math.prod(moved.shape[: first + len(others)])  # explicit: a shard may be empty
    length = math.prod(moved.shape[first + len(others) : first + count])
    return moved.reshape(lines, length, moved.shape[-1]), moved.shape


def unfold_scan_dims(
    out: torch.Tensor, moved_shape: torch.Size, spec: SeqSpec, over: tuple[str, ...]
) -> torch.Tensor:
    """Inverse of :func:`fold_scan_dims` (``out`` may have another channel count)."""
    first, count = spec.first_axis, len(spec.names)
    over_axes = [spec.axis(d) for d in over]
    others = [first + i for i, n in enumerate(spec.names) if n not in over]
    perm = [*range(first), *others, *over_axes, first + count]
    moved = out.reshape(*moved_shape[:-1], out.shape[-1])
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return moved.permute(inverse)


# -- the links --------------------------------------------------------------------------------
def halo_hops(segments: list[int], width: int) -> int:
    """p2p hops after which every segment (lengths in scan order) holds its ``width`` inputs
    before it: one when every segment is at least ``width`` long."""
    if width <= 0:
        return 0
    hops = 0
    for p in range(1, len(segments)):
        need, j = 0, 0
        while j < p and need < width:
            j += 1
            need += segments[p - j]
        hops = max(hops, j)
    return hops


class SegmentLink:
    """This rank's segment of a sequence scanned across the SP group (state passing).

    ``seq_lengths``: tokens per rank in rank order; ``reverse``: the scan runs from the last
    rank to the first (then the segment *before* a rank's, in scan order, is the next rank's).
    :attr:`position` is the rank's segment index in scan order.
    """

    def __init__(self, group: Any, seq_lengths: list[int], reverse: bool = False) -> None:
        self.group = group
        self.seq_lengths = list(seq_lengths)
        self.size = comm.group_size(group)
        self.rank = comm.group_rank(group)
        self.reverse = reverse
        self.position = self.size - 1 - self.rank if reverse else self.rank

    def direction(self, reverse: bool) -> SegmentLink:
        """The same segment for a scan in the given direction."""
        return type(self)(self.group, self.seq_lengths, reverse)

    @property
    def segments(self) -> list[int]:
        """Segment lengths in scan order."""
        return self.seq_lengths[::-1] if self.reverse else self.seq_lengths

    def halo(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The ``width`` inputs before this segment (zeros before the first): ``x`` is this
        segment ``[B, C, L_r]`` in scan order (flipped for a reverse scan) → ``[B, C, width]``.

        Each hop sends every rank's last ``width`` inputs (its own, preceded by what it has
        received so far) one segment along the scan: :func:`halo_hops` hops in all.
        """
        shift = -1 if self.reverse else 1
        incoming = x.new_zeros((*x.shape[:-1], width))
        keep = 0.0 if self.position == 0 else 1.0  # the first segment has nothing before it
        for _ in range(halo_hops(self.segments, width)):
            tail = torch.cat([incoming, x], dim=-1)[..., -width:]
            incoming = comm.ring_exchange(tail.contiguous(), self.group, shift) * keep
        return incoming

    def summaries(
        self, decay: torch.Tensor, contribution: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment's ``(decay, contribution)`` in scan order, in one all-gather.

        ``decay``/``contribution``: this segment's summary (any shapes, one dtype) →
        ``[R, *decay.shape]`` and ``[R, *contribution.shape]``. Backward: one reduce-scatter
        (every rank uses the others' summaries differently: for its own incoming state).
        """
        packed = torch.cat([decay.reshape(-1), contribution.reshape(-1)]).unsqueeze(0)
        everyone = comm.gather_for_local_use(packed, 0, self.group, self.size)
        if self.reverse:
            everyone = everyone.flip(0)
        decays, contributions = everyone.split([decay.numel(), contribution.numel()], dim=1)
        return (
            decays.reshape(self.size, *decay.shape),
            contributions.reshape(self.size, *contribution.shape),
        )


class HeadLink(SegmentLink):
    """This rank's segment, and the all-to-alls that trade it for whole-sequence heads.

    ``to_heads``/``from_heads`` move a ``[B, L, H, W]`` tensor between sequence shards (axis 1,
    ``seq_lengths`` per rank) and head shards (axis 2, balanced over the ranks).
    """

    def heads(self, count: int) -> slice:
        """This rank's heads (channels) among ``count``."""
        sizes = shard_sizes(count, self.size)
        start = sum(sizes[: self.rank])
        return slice(start, start + sizes[self.rank])

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L_r, H, W]`` → ``[B, L, H_r, W]`` (one all-to-all; backward the reverse)."""
        return comm.switch(x, 1, 2, self.group, sum(self.seq_lengths), src_sizes=self.seq_lengths)

    def from_heads(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        """``[B, L, H_r, W]`` → ``[B, L_r, H, W]`` (one all-to-all; backward the reverse)."""
        return comm.switch(y, 2, 1, self.group, heads, dst_sizes=self.seq_lengths)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L_r, W]`` → ``[B, L, W]`` for local use (backward: reduce-scatter).

        The segments are ``seq_lengths`` (agreed by :func:`agree_segments`), which need not be
        a balanced split of ``L``: a raster scan's segments are the sharded dim's shards times
        the tokens per row of it (``t`` = 5 over 2 ranks with 15 per row: 45 and 30)."""
        return _GatherSegments.apply(x, self.group, tuple(self.seq_lengths), current_region())


class _GatherSegments(torch.autograd.Function):
    """All-gather of axis 1 in segments of given sizes; backward reduce-scatters them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: tuple[int, ...], region: str):
        ctx.group, ctx.sizes, ctx.region = group, list(sizes), region
        return all_gather_along(x, 1, ctx.sizes, group, region)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return reduce_scatter_along(grad, 1, ctx.sizes, ctx.group, ctx.region), None, None, None


def agree_segments(x: torch.Tensor, group: Any, seq_lengths: list[int], method: str) -> None:
    """Every rank raises the same error unless each holds its segment of ``seq_lengths``
    (``x``: ``[B', L_r, C]``) with the same batch, channels and dtype."""
    sig = Signature("selective_scan")
    sig.sizes("sequence lengths per rank", seq_lengths).arg("method", zlib.crc32(method.encode()))
    sig.tensor("x", x, sharded=(1,)).local("tokens", x.shape[1])
    agreed = agree(sig, group, x.device)
    agreed.check_rows("tokens", seq_lengths, f"the {method} scan's segments {seq_lengths}")
    if min(seq_lengths) == 0:  # agreed above: every rank raises here, none enters a collective
        raise ValueError(
            f"the {method} scan needs at least one token of the scanned sequence on every rank, "
            f"but its segments per rank are {seq_lengths}: the sharded (outermost scanned) dim "
            f"has fewer positions than the {len(seq_lengths)} ranks; use an SP size of at most "
            f"{sum(1 for n in seq_lengths if n)} or a longer input"
        )


def state_passing_scan(
    sp: SeqParallel, op: ScanOp, x: torch.Tensor, seq_lengths: list[int]
) -> torch.Tensor:
    """Run ``op`` on this rank's segment ``[B', L_r, C]`` with state passed between ranks."""
    agree_segments(x, sp.group, seq_lengths, "state_passing")
    return op.forward_segment(x, SegmentLink(sp.group, seq_lengths))


def head_a2a_scan(
    sp: SeqParallel, op: ScanOp, x: torch.Tensor, seq_lengths: list[int]
) -> torch.Tensor:
    """Run ``op`` on this rank's segment ``[B', L_r, C]`` with whole-sequence heads."""
    agree_segments(x, sp.group, seq_lengths, "head_a2a")
    return op.forward_heads(x, HeadLink(sp.group, seq_lengths))


# -- byte formulas ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ScanShape:
    """One scan mixer over a sharded sequence, as the byte formulas see it.

    ``seq[r]``: tokens on rank ``r``; ``batch``: folded lines; ``directions``: 1, or 2 when
    bidirectional; ``conv_channels`` and ``conv_halo`` (``K−1``): the conv's halo per line;
    ``summary``: elements of one line's ``(decay, contribution)`` per direction, items of
    ``summary_itemsize`` bytes; ``heads``: units the head all-to-all shards, ``head_in`` /
    ``head_out`` elements per (token, head) sent to the heads and back, ``gathered`` elements
    per token gathered for local use (``B``, ``C``); activations of ``itemsize`` bytes.
    ``flops_per_token``: forward FLOPs of the mixer per token of one line, every direction
    (the cost model's compute; the methods' bytes do not read it). For the activation memory
    of state passing: ``decay``, the elements of ``summary`` that are the decay (the rest is
    the state), and ``correction``, the elements per token the incoming state's correction
    keeps for backward.

    What one process's mixer saves for backward (:func:`mixer_saved_elements`), every
    direction: ``saved_token`` elements per token, ``saved_line`` per line (the conv halo, an
    initial state); a chunked scan (``chunk`` ``Q`` > 0, Mamba-2's SSD) also ``saved_padded``
    per token of the line padded to whole chunks of ``Q' = min(Q, L)``, ``saved_square`` per
    padded token and position of its chunk (the ``[Q', Q']`` decay and score blocks),
    ``saved_batched`` per padded token only when there are several chunks (the copies the
    einsums make to batch them; a single chunk is a view),
    ``saved_state`` per chunk state (``2k + 1`` of them for ``k`` chunks: the states entering
    the chunks, and those with the initial one stacked) and ``saved_decay`` per pair of chunk
    boundaries (the ``[k+1, k+1]`` decays between them).
    """

    seq: tuple[int, ...]
    batch: int
    directions: int
    conv_channels: int
    conv_halo: int
    summary: int
    summary_itemsize: int
    heads: int
    head_in: int
    head_out: int
    gathered: int
    itemsize: int
    flops_per_token: float = 0.0
    decay: int = 0
    correction: int = 0
    saved_token: float = 0.0
    saved_line: float = 0.0
    chunk: int = 0
    saved_padded: float = 0.0
    saved_square: float = 0.0
    saved_batched: float = 0.0
    saved_state: float = 0.0
    saved_decay: float = 0.0


def mixer_saved_elements(shape: ScanShape, length: int) -> float:
    """Elements one process's mixer of ``shape`` saves for backward on one line of ``length``
    tokens (see :class:`ScanShape`; 0 for an empty line)."""
    if length <= 0:
        return 0.0
    total = length * shape.saved_token + shape.saved_line
    if shape.chunk > 0:
        chunk = min(shape.chunk, length)
        chunks = -(-length // chunk)
        padded = chunks * chunk
        total += padded * (shape.saved_padded + chunk * shape.saved_square)
        total += padded * shape.saved_batched if chunks > 1 else 0.0
        total += (2 * chunks + 1) * shape.saved_state + (chunks + 1) ** 2 * shape.saved_decay
    return float(total)


def state_passing_saved_elements(shape: ScanShape, rank: int) -> float:
    """Elements state passing saves for backward on rank ``rank`` beyond what one process saves
    for the same local tokens, per mixer: per token of a line and direction the incoming
    state's correction (``correction``: its decay products and what the outputs read), per
    line and direction the summaries of all ``N`` segments and the exclusive scan over them:
    ``N·(4·state + decay)`` (the state part is kept four times: gathered, scanned, the incoming
    state and its decayed copy)."""
    n = len(shape.seq)
    state = shape.summary - shape.decay
    per_line = shape.seq[rank] * shape.correction + n * (4 * state + shape.decay)
    return float(shape.directions * shape.batch * per_line)


def halo_bytes(out: Any, shape: ScanShape) -> None:
    """The conv halo of every direction: ``hops`` p2p sends of ``[B', C_conv, K−1]`` forward,
    the same backward (gradients sent back)."""
    block = shape.batch * shape.conv_channels * shape.conv_halo * shape.itemsize
    for reverse in range(shape.directions):
        segments = list(shape.seq[::-1] if reverse else shape.seq)
        hops = halo_hops(segments, shape.conv_halo)
        for phase in ("forward", "backward"):
            out.add("p2p", phase, hops * block, count=hops)

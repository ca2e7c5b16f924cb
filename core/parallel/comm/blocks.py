"""Block layout: the one pack and the one unpack routine behind every collective.

A collective over ``N`` ranks moves a tensor cut along one axis into blocks ``q = 0 … N−1`` of
``sizes[q]`` rows (:func:`dspzoo.core.parallel.layout.shard_sizes`). On the wire the blocks lie end to end,
each a contiguous tensor with the source's axis order (so the receiver can read a block as a
tensor), optionally padded with zero rows to a common length (all-gather and reduce-scatter
need equal chunks).

* :func:`pack_blocks` writes such a buffer from a tensor of any strides (one copy at most; none
  when the blocks already lie that way in memory).
* :func:`empty_blocks` allocates a receive buffer and :func:`unpack_blocks` joins the received
  blocks along their axis. When every axis before the block axis has size 1 and there is no
  padding, the blocks laid end to end *are* the joined tensor: the receive buffer is allocated in
  its final shape and returned as is (no copy, and not a view of anything). Otherwise unpack
  makes exactly one copy into a fresh tensor.
"""

from __future__ import annotations

import math

import torch


def offsets(sizes: list[int]) -> list[int]:
    """Start of each block: the exclusive prefix sums of ``sizes``."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _block_shape(shape: list[int] | torch.Size, axis: int, rows: int) -> list[int]:
    block = list(shape)
    block[axis] = rows
    return block


def pack_blocks(
    x: torch.Tensor,
    axis: int,
    sizes: list[int],
    keep: range | None = None,
    pad_to: int | None = None,
) -> torch.Tensor:
    """Flat buffer of the blocks ``x.narrow(axis, offset_q, sizes[q])`` for ``q`` in ``keep``.

    ``sizes`` cut all of ``x``'s ``axis``; ``keep`` (a range, default all) picks the blocks to
    send; ``pad_to`` pads each block with zero rows to that many. The result is a view of ``x``
    when the blocks already lie that way in memory, else one copy into a fresh buffer.
    """
    keep = range(len(sizes)) if keep is None else keep
    rows = [sizes[q] if pad_to is None else pad_to for q in keep]
    per_row = _numel_per_row(x, axis)
    total = per_row * sum(rows)
    if len(set(sizes)) == 1 and (pad_to is None or pad_to == sizes[0]):
        if blocks_in_place(x, axis, sizes, keep):
            return _blocks(x, axis, sizes, keep).reshape(-1)
        blocks = _blocks(x, axis, sizes, keep)
        out = torch.empty(total, dtype=x.dtype, device=x.device)
        out.view(blocks.shape).copy_(blocks)
        return out
    out = torch.empty(total, dtype=x.dtype, device=x.device)
    start, starts = 0, offsets(sizes)
    for q, r in zip(keep, rows):
        block = _block_shape(x.shape, axis, r)
        slot = out[start : start + per_row * r].view(block)
        slot.narrow(axis, 0, sizes[q]).copy_(x.narrow(axis, starts[q], sizes[q]))
        if r > sizes[q]:
            slot.narrow(axis, sizes[q], r - sizes[q]).zero_()
        start += per_row * r
    return out


def _blocks(x: torch.Tensor, axis: int, sizes: list[int], keep: range) -> torch.Tensor:
    """Equal blocks ``keep`` of ``x`` cut along ``axis``, stacked on a new leading axis (a view)."""
    blocks = x.unflatten(axis, (len(sizes), sizes[0])).movedim(axis, 0)
    return blocks[keep.start : keep.stop]


def blocks_in_place(x: torch.Tensor, axis: int, sizes: list[int], keep: range) -> bool:
    """Whether the blocks ``keep`` already lie end to end in ``x``'s memory (sending needs no copy)."""
    return len(set(sizes)) == 1 and _blocks(x, axis, sizes, keep).is_contiguous()


def _numel_per_row(x: torch.Tensor, axis: int) -> int:
    """Elements in one row of ``axis`` (well defined when the axis is empty too)."""
    return math.prod(s for i, s in enumerate(x.shape) if i != axis)


def _direct(shape: list[int], axis: int, sizes: list[int], pad_to: int | None) -> bool:
    """Whether the blocks laid end to end already are the joined tensor of ``shape``."""
    unpadded = pad_to is None or all(s == pad_to for s in sizes)
    return unpadded and math.prod(shape[:axis]) == 1


def empty_blocks(
    shape: list[int],
    axis: int,
    sizes: list[int],
    like: torch.Tensor,
    pad_to: int | None = None,
) -> torch.Tensor:
    """Receive buffer for blocks that :func:`unpack_blocks` joins into a tensor of ``shape``.

    Pass ``buffer.view(-1)`` to the collective. Shaped ``shape`` when the blocks need no
    rearranging, else flat.
    """
    if _direct(shape, axis, sizes, pad_to):
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    rows = sum(sizes) if pad_to is None else pad_to * len(sizes)
    return torch.empty(
        math.prod(_block_shape(shape, axis, rows)), dtype=like.dtype, device=like.device
    )


def unpack_blocks(
    buf: torch.Tensor,
    axis: int,
    sizes: list[int],
    shape: list[int],
    pad_to: int | None = None,
) -> torch.Tensor:
    """Join the received blocks (``sizes[q]`` rows each, padded to ``pad_to``) along ``axis``.

    Inverse of :func:`pack_blocks` for a buffer from :func:`empty_blocks`. Returns that buffer
    itself when it is already the result, else one copy into a fresh tensor; never a view.
    """
    if _direct(shape, axis, sizes, pad_to):
        assert list(buf.shape) == list(shape), "allocate the buffer with empty_blocks"
        return buf
    flat = buf.view(-1)
    out = torch.empty(shape, dtype=buf.dtype, device=buf.device)
    n = len(sizes)
    if len(set(sizes)) == 1 and (pad_to is None or pad_to == sizes[0]):
        block = _block_shape(shape, axis, sizes[0])
        out.unflatten(axis, (n, sizes[0])).movedim(axis, 0).copy_(flat.view(n, *block))
        return out
    start, starts = 0, offsets(sizes)
    for q, size in enumerate(sizes):
        rows = size if pad_to is None else pad_to
        block = _block_shape(shape, axis, rows)
        count = math.prod(block)
        got = flat[start : start + count].view(block).narrow(axis, 0, size)
        out.narrow(axis, starts[q], size).copy_(got)
        start += count
    return out

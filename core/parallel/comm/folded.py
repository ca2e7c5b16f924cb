"""A switch's all-to-all with one status word per chunk folded into the payload.

The rehearsed (predicted) form of :func:`~.exchange.switch` (see :mod:`.rehearsal`): every
chunk a rank sends carries a header of :func:`header_len` elements (64 bytes, so the data after
it stays aligned) holding the sender's status, :data:`OK` when its call is the predicted one,
:data:`MISS` when it is not (then the chunk's data is zeros of the predicted size). After the
one ``all_to_all_single`` every rank has read every other rank's status, so every rank knows
whether the whole group matched the prediction, with no collective of its own.

Where the header goes costs nothing when the sender packs its blocks anyway (the pack writes
into a buffer with a gap per chunk, same bytes copied): rank 0 puts it before each chunk's data,
the other ranks after. So on the receiver the chunk from rank 0 starts with its header and the
chunk from rank ``N−1`` ends with its; with two ranks the received data is contiguous and, when
the blocks need no rearranging, is the result as received (a view past the header, no copy).
With three or more ranks the headers of the middle ranks' chunks sit between data blocks and
the receiver joins the blocks with one copy (a layout that needs an unpack copy anyway pays
nothing more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .blocks import _direct, _send_buffer, offsets, result_tensor, unpack_blocks
from .settings import contiguous_strides

OK, MISS = 0, 1


def header_len(dtype: torch.dtype) -> int:
    """Elements of one chunk header: 64 bytes (at least one element)."""
    return max(1, 64 // torch.empty((), dtype=dtype).element_size())


def _block_numel(shape: list[int], axis: int, rows: int) -> int:
    return math.prod(s for i, s in enumerate(shape) if i != axis) * rows


def pack_with_headers(
    x: torch.Tensor | None,
    axis: int,
    sizes: list[int],
    keep: range,
    per_row: int,
    head_first: bool,
    status: int,
    like: torch.Tensor,
    group: Any,
) -> torch.Tensor:
    """Send buffer: for each ``q`` in ``keep``, a header then block ``q`` of ``x`` (or the reverse).

    ``x`` is ``None`` for a rank that missed the prediction: its blocks are zeros of the
    predicted sizes. ``like`` gives dtype and device.
    """
    h = header_len(like.dtype)
    counts = [sizes[q] * per_row for q in keep]
    out = _send_buffer(sum(counts) + h * len(keep), like, reuse=True, group=group)
    if x is None:
        out.zero_()
    uniform = len(set(sizes)) == 1
    if uniform and x is not None and keep:
        b = counts[0]
        rows = out.view(len(keep), b + h)
        data = rows[:, h:] if head_first else rows[:, :b]
        blocks = x.unflatten(axis, (len(sizes), sizes[0])).movedim(axis, 0)
        data.unflatten(1, blocks.shape[1:]).copy_(blocks[keep.start : keep.stop])
        (rows[:, :h] if head_first else rows[:, b:]).fill_(status)
        return out
    start, starts = 0, offsets(sizes)
    for q, count in zip(keep, counts):
        data_at = start + h if head_first else start
        head_at = start if head_first else start + count
        if x is not None:
            block = x.narrow(axis, starts[q], sizes[q])
            out[data_at : data_at + count].view(block.shape).copy_(block)
        out[head_at : head_at + h].fill_(status)
        start += count + h
    return out


@dataclass(frozen=True)
class FoldedLayout:
    """Where everything of one rank's folded switch lies; computed once per rehearsed call.

    ``meta`` is the rank's ``exchange._SwitchMeta``. Blocks ``keep`` go through the all-to-all
    (the end ranks copy their own block in place instead); in the receive buffer of ``total``
    elements, block ``p`` starts at ``starts[p]`` and the headers of the received chunks at
    ``heads``.
    """

    meta: Any
    h: int
    per_row: int
    keep: range
    send_splits: list[int]
    recv_splits: list[int]
    starts: list[int]
    heads: list[int]
    total: int
    own_offset: int  # where this rank's own block starts along ``dst`` in its input
    joined: bool  # the received data is contiguous and already the result (a view)

    @classmethod
    def build(cls, meta: Any, dtype: torch.dtype) -> FoldedLayout:
        n, r = len(meta.send_splits), meta.rank
        h = header_len(dtype)
        local_own = r in (0, n - 1)
        keep = range(1, n) if r == 0 else range(n - 1) if r == n - 1 else range(n)
        counts = list(meta.recv_splits)
        starts, heads, pos = [], [], 0
        for p, count in enumerate(counts):
            if local_own and p == r:
                starts.append(pos)
                pos += count
            elif p == 0:  # rank 0 puts its header first, the others last
                heads.append(pos)
                starts.append(pos + h)
                pos += count + h
            else:
                starts.append(pos)
                heads.append(pos + count)
                pos += count + h
        contiguous = all(starts[p + 1] == starts[p] + counts[p] for p in range(n - 1))
        return cls(
            meta=meta,
            h=h,
            per_row=_block_numel(meta.x_shape, meta.dst, 1),
            keep=keep,
            send_splits=[meta.send_splits[q] + h if q in keep else 0 for q in range(n)],
            recv_splits=[counts[p] + h if p in keep else 0 for p in range(n)],
            starts=starts,
            heads=heads,
            total=pos,
            own_offset=offsets(meta.dst_sizes)[r],
            joined=contiguous and _direct(meta.y_shape, meta.src, meta.src_sizes, None),
        )


def exchange_with_headers(
    x: torch.Tensor | None,
    layout: FoldedLayout,
    like: torch.Tensor,
    group: Any,
    status: int,
) -> tuple[torch.Tensor | None, bool]:
    """One folded switch exchange; ``(result, every rank sent OK)``.

    ``x`` is ``None`` on a rank that missed the prediction (it sends zeros and :data:`MISS`, and
    gets no result). Synchronous; the result is ``None`` unless every rank sent :data:`OK`.
    """
    meta, r = layout.meta, layout.meta.rank
    send = pack_with_headers(
        x, meta.dst, meta.dst_sizes, layout.keep, layout.per_row, r == 0, status, like, group
    )
    flat = result_tensor([layout.total], like, group)
    own_count = meta.recv_splits[r]
    local_own = len(layout.keep) < len(meta.send_splits)
    if not local_own:
        area = flat
    elif r == 0:
        area = flat[own_count:]
    else:
        area = flat[: layout.total - own_count]
    work = dist.all_to_all_single(
        area, send, layout.recv_splits, layout.send_splits, group=group, async_op=True
    )
    if local_own and x is not None:  # own block straight into place while the others travel
        own = x.narrow(meta.dst, layout.own_offset, meta.dst_sizes[r])
        start = layout.starts[r]
        flat[start : start + own_count].view(own.shape).copy_(own)
    work.wait()
    heads = layout.heads
    statuses = flat[heads].tolist() if len(heads) > 1 else [flat[heads[0]].item()]
    if x is None or status != OK or any(s != OK for s in statuses):
        return None, False
    return _join(flat, layout, group), True


def _join(flat: torch.Tensor, layout: FoldedLayout, group: Any) -> torch.Tensor:
    """The switched tensor from the received blocks (on their storage when they already are it).

    Never a view: the result of a switch may be modified in place like any fresh tensor.
    """
    meta = layout.meta
    src, sizes, shape, counts = meta.src, meta.src_sizes, meta.y_shape, meta.recv_splits
    if layout.joined:
        out = torch.empty(0, dtype=flat.dtype, device=flat.device)
        strides = contiguous_strides(shape)
        return out.set_(flat.untyped_storage(), layout.starts[0], shape, strides)
    if all(layout.starts[p + 1] == layout.starts[p] + counts[p] for p in range(len(counts) - 1)):
        return unpack_blocks(
            flat[layout.starts[0] : layout.starts[0] + sum(counts)], src, sizes, shape, group=group
        )
    out = result_tensor(shape, flat, group)
    for p, (start, offset) in enumerate(zip(layout.starts, offsets(sizes))):
        block = list(shape)
        block[src] = sizes[p]
        out.narrow(src, offset, sizes[p]).copy_(flat[start : start + counts[p]].view(block))
    return out

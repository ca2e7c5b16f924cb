"""Long-Short-Sequence (LSS) transformer attention: local queries, one fused K/V all-gather.

Each rank keeps its contiguous segment of queries. Keys and values of every segment arrive in
one collective: this rank's k and v are concatenated along the last axis into one buffer
``[B, seq_r, Hkv, 2·D]`` and that buffer is all-gathered along the sequence with
:func:`dspzoo.core.parallel.comm.gather_for_local_use`. That is what "fused communication" means here:
**one all-gather of [k|v] instead of two** (one launch, one synchronisation, the same bytes). Its
backward is a reduce-scatter of the [dk|dv] buffer (each rank's queries produce gradients for
every key; the sums go back to the keys' owners), so the gradients are exact.

The local queries then attend to all keys with causal masking by global offsets (query ``i`` of
rank ``r`` sits at ``offset_r + i`` and sees keys ``j <= offset_r + i``; keys past the segment's
last query are not even read). GQA/MQA never expands K/V: the gathered buffer has ``Hkv`` heads.

Memory: the kernel is :func:`dspzoo.core.parallel.methods.blockwise.chunked_attention` (imported lazily;
blocks of ``chunk`` queries × ``chunk`` keys with a running log-sum-exp, native GQA, only
q, k, v, out and the log-sum-exp saved for backward). Without that module the fallback folds
each KV group's ``g = H / Hkv`` query heads into the query rows (``[B, seq_r·g, Hkv, D]``) and
calls :func:`~dspzoo.core.layers.attention.attend`: once without a mask when not causal, else
per chunk of query rows with an explicit ``[rows, keys]`` boolean mask, each chunk
checkpointed so that backward recomputes one chunk's scores at a time. Either way no
``seq_r × L`` score matrix exists at once (64K tokens at SP 4: 16K × 64K float32 scores are
4 GiB per head and batch element).

Bytes sent per rank (``N`` ranks, ``m = max(seq_lengths)``, ``B·Hkv·2·D`` elements per token):
forward all-gather ``(N−1)·m·B·Hkv·2D·itemsize`` — when ``N`` divides ``L`` that is
``(N−1)/N`` of the global K and V bytes, i.e. each rank receives the ``(N−1)/N`` of K and V it
does not hold — and the backward reduce-scatter sends the same. Uneven splits move the padded
chunk (``m`` rows), as every all-gather in :mod:`dspzoo.core.parallel.comm` does.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ...layers.attention import attend
from ..comm import group_rank, group_size
from ..comm.replicate import gather_for_local_use_agreed
from ..layout import shard_sizes
from ..trace import comm_region
from .ulysses import agree_attention_args, scaled

DEFAULT_CHUNK = 2048


def _blockwise_kernel() -> Any | None:
    """``dspzoo.core.parallel.methods.blockwise.chunked_attention`` when that module exists, else ``None``."""
    try:
        module = importlib.import_module(f"{__package__}.blockwise")
    except ImportError:
        return None
    return getattr(module, "chunked_attention", None)


def _gather_kv(kv: torch.Tensor, seq_lengths: list[int], group: Any) -> torch.Tensor:
    """All-gather ``[B, seq_r, Hkv, 2D]`` along the sequence → ``[B, L, Hkv, 2D]``."""
    n, total = len(seq_lengths), sum(seq_lengths)
    if seq_lengths == shard_sizes(total, n):
        return gather_for_local_use_agreed(kv, 1, group, total)
    # any other split: pad every segment to the longest, gather, keep the real rows
    rows = max(seq_lengths)
    padded = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, rows - kv.shape[1]))
    full = gather_for_local_use_agreed(padded, 1, group, rows * n)
    index = torch.cat([torch.arange(q * rows, q * rows + s) for q, s in enumerate(seq_lengths)])
    return full.index_select(1, index.to(kv.device))


def _fold_groups(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, s, H, D]`` → ``[B, s·g, Hkv, D]``: query head ``h`` reads KV head ``h // g``."""
    b, s, h, d = q.shape
    g = h // kv_heads
    if g == 1:
        return q
    return q.view(b, s, kv_heads, g, d).transpose(2, 3).reshape(b, s * g, kv_heads, d)


def _unfold_groups(out: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_fold_groups`: ``[B, s·g, Hkv, D]`` → ``[B, s, H, D]``."""
    b, sg, kv_heads, d = out.shape
    g = heads // kv_heads
    if g == 1:
        return out
    return out.view(b, sg // g, g, kv_heads, d).transpose(2, 3).reshape(b, sg // g, heads, d)


def _masked_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Causal attention by global positions, ``chunk`` query rows at a time, with ``attend``.

    Each chunk builds its own ``[chunk, keys]`` boolean mask and is checkpointed: autograd keeps
    only q, k, v (views) and the backward recomputes one chunk's scores at a time, whatever
    the kernel behind ``attend`` would have saved.
    """

    def one_chunk(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor):
        mask = k_pos[None, : kc.shape[1]] <= pos[:, None]
        return attend(qc, kc, vc, mask=mask[None, None])

    outs = []
    for start in range(0, q.shape[1], chunk):
        stop = min(start + chunk, q.shape[1])
        pos = q_pos[start:stop]
        keys = int(torch.searchsorted(k_pos, pos.max(), right=True))  # k_pos is increasing
        qc, kc, vc = q[:, start:stop], k[:, :keys], v[:, :keys]
        if torch.is_grad_enabled() and (qc.requires_grad or kc.requires_grad or vc.requires_grad):
            outs.append(checkpoint(one_chunk, qc, kc, vc, pos, use_reentrant=False))
        else:
            outs.append(one_chunk(qc, kc, vc, pos))
    return torch.cat(outs, dim=1)


def lss_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    seq_lengths: list[int],
    causal: bool = False,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """LSS distributed self-attention over a sequence sharded contiguously on ``group``.

    Args:
        q: this rank's queries ``[B, seq_lengths[r], H, D]``.
        k, v: this rank's keys and values ``[B, seq_lengths[r], Hkv, D]``; ``Hkv`` divides ``H``.
        group: the SP process group (``None``: one process).
        seq_lengths: tokens held by each rank, in rank order (any split, zeros allowed; the
            balanced ``shard_sizes`` split needs no padding rows).
        causal: query ``offset_r + i`` sees keys ``j <= offset_r + i``.
        scale: softmax scale (default ``1/sqrt(D)``).
        chunk: rows per block of the memory-bounded kernel.

    Returns:
        this rank's output ``[B, seq_lengths[r], H, D]``. Every rank must backpropagate
        through its output (an empty one included): the backward reduce-scatters.

    One tiny all-gather agreeing on the arguments (a bad input on any rank raises the same
    error on every rank), one all-gather of the fused ``[k|v]`` buffer forward, one
    reduce-scatter backward; see the module docstring for the bytes.
    """
    n, r = group_size(group), group_rank(group)

    def check_chunk() -> None:
        if chunk < 1:
            raise ValueError(f"lss_attention: chunk must be >= 1, got {chunk}")

    agree_attention_args(q, k, v, seq_lengths, group, "lss_attention", causal, scale, check_chunk)
    lengths = [int(s) for s in seq_lengths]
    offset, d, heads, kv_heads = sum(lengths[:r]), q.shape[3], q.shape[2], k.shape[2]
    kv = torch.cat([k, v], dim=-1)
    with comm_region("lss"):
        kv_all = kv if n == 1 else _gather_kv(kv, lengths, group)
    if causal:  # keys after this segment's last query are never attended to
        kv_all = kv_all[:, : offset + lengths[r]]
    if q.shape[1] == 0 or kv_all.shape[1] == 0:
        # nothing to compute; keep the edge to the gathered K/V so the backward collective runs
        return q + 0 * kv_all.sum()
    k_all, v_all = kv_all[..., :d], kv_all[..., d:]
    q_pos = torch.arange(offset, offset + lengths[r], device=q.device)
    k_pos = torch.arange(k_all.shape[1], device=q.device)
    kernel = _blockwise_kernel()
    if kernel is not None:  # blockwise log-sum-exp kernel; handles GQA itself
        return kernel(
            q, k_all, v_all, causal=causal, q_pos=q_pos, k_pos=k_pos, scale=scale, chunk=chunk
        )
    # fallback: fold each KV group's query heads into the query rows, then attend
    g = heads // kv_heads
    q_f = scaled(_fold_groups(q, kv_heads), scale)
    if causal:
        out = _masked_chunks(q_f, k_all, v_all, q_pos.repeat_interleave(g), k_pos, chunk * g)
    else:
        out = attend(q_f, k_all, v_all)
    return _unfold_groups(out, heads)

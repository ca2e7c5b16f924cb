"""The real peer: DeepSpeed-Ulysses' own ``DistributedAttention`` in place of our attention.

Used only by the benchmark. :class:`DeepSpeedUlysses` is a :class:`SeqParallel` planned as
our ``ulysses`` strategy (one dim sharded, same layout), whose attention over the sharded dim
calls ``deepspeed.sequence.layer.DistributedAttention`` on the folded ``[Bf, L/N, H, D]``
tensors instead of :func:`dspzoo.core.parallel.methods.ulysses_attention`. DeepSpeed's collectives do
not go through :mod:`dspzoo.core.parallel.comm`, so :func:`count_deepspeed_bytes` counts what its
``all_to_all_single`` calls send to other ranks (equal splits: ``(N−1)/N`` of the input).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch

from ..layers.attention import attend
from ..parallel.runtime import SeqParallel
from ..parallel.strategies.base import fold_attention_dims, local_attention, unfold_attention_dims


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def init_deepspeed() -> None:
    """``deepspeed.init_distributed`` on gloo over the already-initialised process group."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_cannot_run(
    lengths: dict[str, int], sharded: str, heads: int, kv_heads: int, n: int
) -> str | None:
    """Why DeepSpeed-Ulysses cannot run this case at SP ``n`` (``None`` if it can).

    Its all-to-all splits the local sequence and the heads in ``n`` equal parts: a sharded
    length ``n`` does not divide would abort a gloo worker ("Received data size doesn't match
    expected size"), fewer heads than ranks fail its assertion, uneven heads need an mpu.
    """
    if lengths[sharded] % n:
        return f"sequence dim {sharded}={lengths[sharded]} not divisible by SP {n}"
    if heads < n:
        return f"heads {heads} < SP {n} (DeepSpeed asserts at least the SP size)"
    if heads % n or kv_heads % n:
        return f"heads {heads} / kv heads {kv_heads} not divisible by SP {n}"
    return None


class _Local:
    """The local attention DeepSpeed calls on ``[B, L, H/N, D]`` (GQA expanded here)."""

    def __init__(self) -> None:
        self.causal = False
        self.scale: float | None = None

    def __call__(self, q, k, v, *args, **kwargs):
        g = q.shape[2] // k.shape[2]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        return attend(q, k, v, causal=self.causal, scale=self.scale)


class DeepSpeedUlysses(SeqParallel):
    """Our ``ulysses`` plan, DeepSpeed's ``DistributedAttention`` over the sharded dim."""

    def __init__(self, mesh: Any, dim: str | None = None) -> None:
        super().__init__(mesh, "ulysses", dim)
        from deepspeed.sequence.layer import DistributedAttention

        self._local = _Local()
        self._layer = DistributedAttention(self._local, self.group, scatter_idx=2, gather_idx=1)

    def __repr__(self) -> str:
        return f"DeepSpeedUlysses(size={self.size}, rank={self.rank})"

    def attention(self, q, k, v, spec, over, mask=None, causal=False, scale=None):
        over = (over,) if isinstance(over, str) else tuple(over)
        sharded = spec.sharded
        if self.size == 1 or sharded is None or sharded not in over:
            return local_attention(q, k, v, spec, over, mask, causal, scale)
        if mask is not None:
            raise NotImplementedError("DeepSpeed peer: masks over the sharded dim")
        order = (sharded, *[d for d in over if d != sharded])
        qf, moved = fold_attention_dims(q, spec, order)
        kf, _ = fold_attention_dims(k, spec, order)
        vf, _ = fold_attention_dims(v, spec, order)
        self._local.causal, self._local.scale = causal, scale
        out = self._layer(qf, kf, vf, 0)  # batch_dim_idx=0: [Bf, L/N, H, D]
        return unfold_attention_dims(out, moved, spec, order)


class _Counter:
    """The bytes DeepSpeed's all-to-alls sent, by (phase, dtype name)."""

    def __init__(self) -> None:
        self.by_dtype: dict[tuple[str, str], int] = {}  # (phase, dtype name) -> bytes
        self.phase = "forward"

    @property
    def total(self) -> int:
        """Every byte counted, both phases, every dtype."""
        return sum(self.by_dtype.values())

    def add(self, tensor: torch.Tensor, n: int) -> None:
        """Count ``n`` bytes of ``tensor``'s all-to-all in the current phase."""
        key = (self.phase, str(tensor.dtype).removeprefix("torch."))
        self.by_dtype[key] = self.by_dtype.get(key, 0) + n


@contextlib.contextmanager
def count_deepspeed_bytes() -> Iterator[_Counter]:
    """Count the bytes DeepSpeed's ``all_to_all_single`` sends to other ranks while active;
    set ``counter.phase = "backward"`` before calling ``backward()``."""
    import deepspeed.comm as ds_comm

    counter = _Counter()
    original = ds_comm.all_to_all_single

    def counting(output, tensor, *args, **kwargs):
        group = kwargs.get("group")
        n = torch.distributed.get_world_size(group)
        counter.add(tensor, tensor.numel() * tensor.element_size() * (n - 1) // n)
        return original(output, tensor, *args, **kwargs)

    ds_comm.all_to_all_single = counting
    try:
        yield counter
    finally:
        ds_comm.all_to_all_single = original

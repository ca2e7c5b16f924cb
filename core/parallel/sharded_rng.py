"""Randomness on sharded activations: bit-for-bit the one-process draw, under any sharding.

Dropout inside the sharded region cannot use the global RNG: ranks of an SP group hold shards
of different sizes (``shard_sizes(5, 2) == [3, 2]``), so they draw different numbers of values
and their generators drift apart, and ranks with equal shards draw *the same* mask for
different parts of the activation. Neither matches what one process would draw.

Here every random value is a pure function of ``(key, global coordinates)`` — a counter-based
generator. A rank computes only the values of the block it holds, from the block's offset in
the global tensor, so

* the values do not depend on the sharded dim, the SP size or the balance of the shards: any
  block of the global random field equals the same block of the one-process draw;
* the global RNG (``torch.manual_seed`` / ``torch.get_rng_state``) is never read or advanced;
* the cost is proportional to the local block (plus, per axis, the local prefix of the shape).

The hash
--------
Coordinates are folded in one axis at a time with the SplitMix64 step, evaluated in torch
``int64`` arithmetic (multiplication and addition wrap mod 2**64; logical right shifts are
emulated with a mask because ``>>`` on ``int64`` is arithmetic)::

    h = splitmix64(key)
    for each axis k:  h = splitmix64(h + c_k · GOLDEN)     # c_k: global coordinate on axis k

Along one axis the values are therefore consecutive outputs of a SplitMix64 stream (a
generator that passes BigCrush) seeded by the hash of the other coordinates. Folding
coordinates rather than hashing a linear index makes a value independent of the global
*shape*: the value at ``(b, t, s, c)`` is the same whatever the lengths of the dims, so there is
no stride to get wrong, no int64 overflow of a linear index, and the batch axis can be offset
freely (``batch_offset``). The per-axis hashes are evaluated with broadcasting, so axis ``k``
costs ``prod(local_shape[: k + 1])`` hashes: about one hash per element in total.

Only integer operations and exact int→float conversions are used, so values are bit-identical
on every process, shard size and device (no transcendental functions, whose vectorised and
scalar tail paths may differ in the last bit).

Keys
----
The caller supplies the key, e.g. ``mix_key(seed, step, layer, "dropout")`` from
:mod:`dspzoo.core.parallel.rng`: a layer that drops out twice in one step needs two streams
(``mix_key(seed, step, layer, "attn_dropout")``, ``… "mlp_dropout"``), and a new step a new key.
The ranks of one SP group must pass the same key.

The batch axis
--------------
Batch and channel axes are never sharded by SP, so their coordinate is the row within the
local tensor. A data-parallel run whose DP groups hold different samples must either mix the DP
group's sample offset into the key or pass ``batch_offset`` (the global index of the local batch's
first sample), which is added to the coordinate on tensor axis 0; with ``batch_offset`` the draws
do not depend on the dp × sp layout at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .layout import SeqSpec, shard_offset
from .rng import splitmix64

if TYPE_CHECKING:
    from .runtime import SeqParallel, SeqTensor

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# the 53 bits of a float64 mantissa: keep masks and uniforms come from the top 53 hash bits
_BITS = 53


def _signed(u: int) -> int:
    """The int64 whose two's-complement bits are the unsigned 64-bit ``u``."""
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


_GOLDEN_S, _M1_S, _M2_S = _signed(_GOLDEN), _signed(_M1), _signed(_M2)


def _lsr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``0 < n < 64`` bits."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _xor_lsr_(z: torch.Tensor, n: int) -> torch.Tensor:
    """``z ^= z >>> n`` in place, with one temporary."""
    t = z >> n
    return z.bitwise_xor_(t.bitwise_and_((1 << (64 - n)) - 1))


def _splitmix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of every element of int64 ``z``, in place (``z`` is returned)."""
    z.add_(_GOLDEN_S)
    _xor_lsr_(z, 30).mul_(_M1_S)
    _xor_lsr_(z, 27).mul_(_M2_S)
    return _xor_lsr_(z, 31)


def _check_block(
    shape: Sequence[int], offsets: Sequence[int] | None, global_shape: Sequence[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = tuple(int(n) for n in shape)
    offsets = (0,) * len(shape) if offsets is None else tuple(int(o) for o in offsets)
    if len(offsets) != len(shape) or any(n < 0 for n in shape) or any(o < 0 for o in offsets):
        raise ValueError(
            f"a random block needs one non-negative offset per axis: shape {shape}, offsets {offsets}"
        )
    if global_shape is not None:
        full = tuple(int(n) for n in global_shape)
        if len(full) != len(shape) or any(
            o + n > g for o, n, g in zip(offsets, shape, full, strict=True)
        ):
            raise ValueError(
                f"random block of shape {shape} at offsets {offsets} does not fit in the global "
                f"shape {full}"
            )
    return shape, offsets


def random_bits(
    key: int,
    shape: Sequence[int],
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """64 random bits (as ``int64``) for each element of a block of the keyed random field.

    Args:
        key: the stream's key (any int; used mod 2**64), e.g. ``mix_key(seed, step, "dropout")``.
        shape: the block's shape.
        offsets: the block's global coordinates on each axis (default: all 0).
        global_shape: if given, checked to contain the block (the values do not depend on it).
        device: where to compute.

    Element ``i`` of the block is the hash of ``key`` and the coordinates ``offsets + i``.
    """
    shape, offsets = _check_block(shape, offsets, global_shape)
    h = torch.full((1,) * len(shape), _signed(splitmix64(int(key) & _MASK64)), dtype=torch.int64)
    h = h.to(device) if device is not None else h
    for axis, (n, off) in enumerate(zip(shape, offsets, strict=True)):
        view = [1] * len(shape)
        view[axis] = n
        coord = torch.arange(off, off + n, dtype=torch.int64, device=h.device).mul_(_GOLDEN_S)
        h = _splitmix64_(h + coord.view(view))
    return h


def uniform(
    key: int,
    shape: Sequence[int],
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Uniform values in ``[0, 1)`` for a block of the keyed random field.

    ``uniform(key, (T, S))[a:b]`` equals ``uniform(key, (b - a, S), offsets=(a, 0))`` bit for bit,
    so a rank draws its shard of a global tensor from the shard's offsets. Values are multiples
    of ``2**-m`` where ``m`` is the precision of ``dtype`` (53 for float64, 24 for float32, 11
    for float16, 8 for bfloat16), taken from the top bits of the hash: exact in ``dtype`` and
    never rounded up to 1.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"uniform needs a floating dtype, got {dtype}")
    bits = min(round(-math.log2(torch.finfo(dtype).eps)) + 1, _BITS)
    h = random_bits(key, shape, offsets, global_shape, device)
    return _lsr(h, 64 - bits).to(dtype).mul_(2.0**-bits)


def _check_p(p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be a number in [0, 1], got {p!r}")
    return float(p)


def keep_mask(
    key: int,
    p: float,
    shape: Sequence[int],
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Boolean mask, ``False`` (drop) with probability ``p``, for a block of the random field.

    Element kept iff its 53-bit uniform ``u`` satisfies ``u >= p``, compared in integers, so the
    mask does not depend on the activation's dtype.
    """
    p = _check_p(p)
    threshold = math.ceil(p * 2.0**_BITS)  # exact: p · 2**53 is a float64 scaling by 2**53
    bits = random_bits(key, shape, offsets, global_shape, device)
    if threshold >= 1 << _BITS:
        return torch.zeros_like(bits, dtype=torch.bool)
    # top53(h) >= t  <=>  h >= t · 2**11 as unsigned  <=>  (h ^ 2**63) >= t · 2**11 - 2**63 signed
    return bits.bitwise_xor_(-(1 << 63)) >= (threshold << (64 - _BITS)) - (1 << 63)


def _norm_axes(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"shared axis {a} is out of range for a {ndim}-dim tensor")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def dropout(
    x: torch.Tensor,
    p: float,
    key: int,
    *,
    training: bool = True,
    offsets: Sequence[int] | None = None,
    global_shape: Sequence[int] | None = None,
    shared_axes: Sequence[int] = (),
) -> torch.Tensor:
    """Keyed inverted dropout of the block ``x`` of a global tensor.

    Args:
        x: the local block (the whole tensor in one process).
        p: drop probability in ``[0, 1]``; kept values are scaled by ``1 / (1 - p)``.
        key: the stream's key (see the module docstring).
        training: ``False`` (or ``p == 0``) returns ``x`` unchanged.
        offsets: ``x``'s global coordinates on each axis (default: all 0). Ignored on
            ``shared_axes``.
        global_shape: if given, checked to contain the block (on ``shared_axes`` it is 1).
        shared_axes: axes along which one mask value is shared (the mask has size 1 there and
            broadcasts): AlphaFold's row- and column-wise dropout.

    The mask is a constant of autograd: the gradient is ``mask · scale · grad_out``. With
    ``p == 1`` the output (and gradient) is zero.
    """
    p = _check_p(p)
    if not training or p == 0.0:
        return x
    shared = _norm_axes(shared_axes, x.dim())
    shape = [1 if a in shared else n for a, n in enumerate(x.shape)]
    offs = (0,) * x.dim() if offsets is None else tuple(offsets)
    if len(offs) != x.dim():
        raise ValueError(f"dropout: {len(offs)} offsets for a {x.dim()}-dim tensor")
    offs = tuple(0 if a in shared else o for a, o in enumerate(offs))
    full = None
    if global_shape is not None:
        full = tuple(1 if a in shared else int(n) for a, n in enumerate(global_shape))
    if p == 1.0:
        return x * torch.zeros(shape, dtype=x.dtype, device=x.device)
    keep = keep_mask(key, p, shape, offs, full, x.device)
    # autograd saves only the boolean mask (broadcast: small when shared)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


# -- sharded helpers --------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardBlock:
    """Where a rank's local tensor sits in the global tensor, for drawing its randomness.

    Attributes:
        shape: the local shape of the random block (1 on shared axes).
        offsets: global coordinates of the block's first element (0 on shared axes).
        global_shape: the global shape of the random field (1 on shared axes).
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def shard_block(
    spec: SeqSpec,
    local_shape: Sequence[int],
    rank: int,
    world: int,
    shared: Sequence[str] = (),
    batch_offset: int = 0,
) -> ShardBlock:
    """The block of the global random field that ``rank`` of a ``world``-sized SP group holds.

    Args:
        spec: the activation's sequence spec (names, global lengths, sharded dim).
        local_shape: the local tensor's shape (checked against ``spec``).
        rank, world: this rank's position in the SP group.
        shared: sequence dim names along which the randomness is shared (extent 1).
        batch_offset: added to the coordinate on tensor axis 0, the batch axis (needs
            ``spec.first_axis >= 1``).
    """
    local_shape = tuple(int(n) for n in local_shape)
    spec.check_local(torch.empty(local_shape, device="meta"), rank, world)
    shared_axes = {spec.axis(name) for name in shared}
    if batch_offset < 0 or (batch_offset and spec.first_axis < 1):
        raise ValueError(
            f"batch_offset={batch_offset} needs a batch axis 0 before the sequence dims "
            f"(first_axis={spec.first_axis}) and must be >= 0"
        )
    full = list(local_shape)
    offsets = [0] * len(local_shape)
    for name, length in zip(spec.names, spec.lengths, strict=True):
        full[spec.axis(name)] = length
    if spec.sharded is not None:
        offsets[spec.axis(spec.sharded)] = shard_offset(spec.length(spec.sharded), world, rank)
    if local_shape:
        offsets[0] += batch_offset
        full[0] += batch_offset
    for a in shared_axes:
        full[a], offsets[a] = 1, 0
    shape = tuple(1 if a in shared_axes else n for a, n in enumerate(local_shape))
    return ShardBlock(shape, tuple(offsets), tuple(full))


def sharded_uniform(
    key: int,
    spec: SeqSpec,
    local_shape: Sequence[int],
    rank: int,
    world: int,
    shared: Sequence[str] = (),
    batch_offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """This rank's block of the one-process ``uniform(key, global_shape)`` (size 1 on ``shared``)."""
    block = shard_block(spec, local_shape, rank, world, shared, batch_offset)
    return uniform(key, block.shape, block.offsets, block.global_shape, dtype, device)


def sharded_dropout(
    x: torch.Tensor,
    p: float,
    key: int,
    spec: SeqSpec,
    rank: int,
    world: int,
    shared: Sequence[str] = (),
    batch_offset: int = 0,
    training: bool = True,
) -> torch.Tensor:
    """Dropout of ``rank``'s shard ``x`` of an activation described by ``spec``.

    Equals the matching slice of ``dropout(x_global, p, key, shared_axes=…)`` in one process,
    bit for bit, whatever the sharded dim and the SP size.
    """
    _check_p(p)
    if not training or p == 0.0:
        return x
    block = shard_block(spec, tuple(x.shape), rank, world, shared, batch_offset)
    shared_axes = tuple(spec.axis(name) for name in shared)
    return dropout(
        x,
        p,
        key,
        offsets=block.offsets,
        global_shape=block.global_shape,
        shared_axes=shared_axes,
    )


def seq_dropout(
    sp: SeqParallel,
    act: SeqTensor,
    p: float,
    key: int,
    shared_along: Sequence[str] = (),
    training: bool = True,
    batch_offset: int = 0,
) -> SeqTensor:
    """:func:`sharded_dropout` of a :class:`SeqTensor` on ``sp``'s group (see ``SeqParallel.dropout``)."""
    out = sharded_dropout(
        act.tensor, p, key, act.spec, sp.rank, sp.size, tuple(shared_along), batch_offset, training
    )
    return act if out is act.tensor else act.with_tensor(out)

"""Named sequence dims and the sharding state that travels with an activation.

An activation such as ``[B, T, S, C]`` has named sequence dims ``("t", "s")`` that sit on
consecutive tensor axes starting at ``first_axis`` (1 here). At most one of them is sharded
over the sequence-parallel (SP) group at a time. Shards are *balanced and unpadded*: with true
length ``L`` over ``N`` ranks, rank ``r`` holds ``L // N + (1 if r < L % N else 0)`` rows, so
every primitive is exact for lengths that ``N`` does not divide and moves no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def shard_sizes(length: int, parts: int) -> list[int]:
    """Balanced, unpadded shard sizes of a dim of ``length`` over ``parts`` ranks."""
    if length < 0 or parts < 1:
        raise ValueError(f"shard_sizes needs length >= 0 and parts >= 1, got {length}, {parts}")
    base, extra = divmod(length, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def shard_offset(length: int, parts: int, rank: int) -> int:
    """Start index of ``rank``'s shard of a dim of ``length`` over ``parts`` ranks."""
    return sum(shard_sizes(length, parts)[:rank])


@dataclass(frozen=True)
class SeqSpec:
    """Sharding state of one activation with named sequence dims.

    Attributes:
        names: sequence dim names in tensor order, e.g. ``("t", "s")``.
        lengths: true global (unsharded) length of each dim.
        first_axis: tensor axis of ``names[0]``; the dims occupy consecutive axes.
        sharded: name of the dim split over the SP group, or ``None`` when replicated.
        method: how the current stage's attention runs when it mixes the sharded dim
            (``"local"``: it must not; ``"ulysses"``, ``"ring"``, ``"lss"``, ``"usp"``: that
            embedded method), set by ``SeqParallel.to_stage`` from the plan.
        layout: how the sharded dim is cut: ``"contiguous"`` (balanced consecutive shards) or
            ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2N−1−r`` of ``2N``: causal load
            balancing for ring attention).
    """

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    first_axis: int = 1
    sharded: str | None = None
    method: str = "local"
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        if len(self.names) != len(self.lengths):
            raise ValueError(
                f"SeqSpec: {len(self.names)} names {self.names} but {len(self.lengths)} lengths {self.lengths}"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"SeqSpec: duplicate dim names in {self.names}")
        if self.sharded is not None and self.sharded not in self.names:
            raise ValueError(f"SeqSpec: sharded dim {self.sharded!r} is not one of {self.names}")
        if self.layout not in ("contiguous", "zigzag"):
            raise ValueError(
                f"SeqSpec: layout must be 'contiguous' or 'zigzag', got {self.layout!r}"
            )

    @classmethod
    def of(cls, x: torch.Tensor, names: tuple[str, ...], first_axis: int = 1) -> SeqSpec:
        """Spec of a replicated tensor ``x`` whose dims ``names`` start at ``first_axis``."""
        if x.dim() < first_axis + len(names):
            raise ValueError(
                f"tensor of shape {tuple(x.shape)} has {x.dim()} dims, too few for sequence dims "
                f"{names} starting at axis {first_axis}"
            )
        lengths = tuple(int(x.shape[first_axis + i]) for i in range(len(names)))
        return cls(names=tuple(names), lengths=lengths, first_axis=first_axis)

    def index(self, name: str) -> int:
        """Position of ``name`` among the sequence dims (raises a clear error if unknown)."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(
                f"unknown sequence dim {name!r}; this activation has dims {self.names}"
            ) from None

    def axis(self, name: str) -> int:
        """Tensor axis of dim ``name``."""
        return self.first_axis + self.index(name)

    def length(self, name: str) -> int:
        """True global length of dim ``name``."""
        return self.lengths[self.index(name)]

    def shard_lengths(self, name: str, world: int) -> list[int]:
        """Rows of dim ``name`` on each rank of a ``world``-sized group (whole if not sharded)."""
        full = self.length(name)
        if name != self.sharded:
            return [full] * world
        if self.layout == "zigzag":
            chunks = shard_sizes(full, 2 * world)
            return [chunks[r] + chunks[2 * world - 1 - r] for r in range(world)]
        return shard_sizes(full, world)

    def local_length(self, name: str, rank: int, world: int) -> int:
        """Length of dim ``name`` held by ``rank`` of a ``world``-sized SP group."""
        return self.shard_lengths(name, world)[rank]

    def local_shape(self, rank: int, world: int) -> tuple[int, ...]:
        """Local lengths of all sequence dims on ``rank``."""
        return tuple(self.local_length(n, rank, world) for n in self.names)

    def with_sharded(self, name: str | None) -> SeqSpec:
        """The same activation sharded on ``name`` (``None``: replicated)."""
        if name is not None:
            self.index(name)
        return replace(self, sharded=name)

    def with_method(self, method: str) -> SeqSpec:
        """The same activation with ``method`` in force for the current stage."""
        return replace(self, method=method)

    def numel_tokens(self) -> int:
        """Number of (global) tokens: product of all sequence lengths."""
        n = 1
        for length in self.lengths:
            n *= length
        return n

    def check_local(self, x: torch.Tensor, rank: int, world: int) -> None:
        """Raise a clear error if ``x`` is not this spec's local shard on ``rank``."""
        want = self.local_shape(rank, world)
        got = tuple(x.shape[self.first_axis : self.first_axis + len(self.names)])
        if x.dim() < self.first_axis + len(self.names) or got != want:
            raise ValueError(
                f"activation of shape {tuple(x.shape)} does not match its sequence spec: dims "
                f"{self.names} at axis {self.first_axis} should be {want} on rank {rank}/{world} "
                f"(global {self.lengths}, sharded={self.sharded!r})"
            )

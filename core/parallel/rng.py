"""Randomness as a pure function of (seed, step, sample): layout-free by construction.

Every random draw of training is keyed, never taken from a global RNG whose state depends on
how many processes ran before: :func:`mix_key` turns ``(seed, step, global sample index,
stream name, …)`` into a 64-bit key, and :class:`SampleRandom` draws per-sample tensors from
generators seeded with such keys. Then

* the ranks of an SP group draw identically (they hold the same samples),
* DP groups draw differently (they hold different samples),
* a run's draws do not depend on the dp × sp layout, and a resumed run (at any layout) draws
  exactly what the uninterrupted run would have.

Randomness on *sharded* activations (dropout inside the sharded region) lives in
:mod:`dspzoo.core.parallel.sharded_rng`, which builds on the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The SplitMix64 finaliser: a bijective, well-mixing map of 64-bit integers."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _as_int(part: int | str) -> int:
    if isinstance(part, bool) or not isinstance(part, int | str):
        raise TypeError(f"mix_key parts must be int or str, got {type(part).__name__}: {part!r}")
    if isinstance(part, str):  # stable across processes (unlike hash(), which PYTHONHASHSEED salts)
        return int.from_bytes(hashlib.blake2b(part.encode(), digest_size=8).digest(), "little")
    return part & _MASK64


def mix_key(*parts: int | str) -> int:
    """A 63-bit key from integers and names, e.g. ``mix_key(seed, step, sample, "noise")``.

    Order matters; equal parts give equal keys in every process, and changing any part gives an
    unrelated key. The result fits ``torch.Generator.manual_seed``.
    """
    h = 0x243F6A8885A308D3
    for part in parts:
        h = splitmix64(h ^ splitmix64(_as_int(part)))
    return h >> 1


def keyed_generator(key: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``key``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(key)
    return gen


@dataclass(frozen=True)
class SampleRandom:
    """The random draws of one training step for a batch of globally indexed samples.

    Attributes:
        seed: the run's seed.
        step: the optimisation step (0-based) the draws belong to.
        samples: the global index of each batch row, e.g. ``step · global_batch + position``.

    Every draw is made per sample on the CPU from a generator keyed by
    ``(seed, step, sample, stream)`` and stacked, so row ``i`` is the same whichever process,
    batch split or device draws it.
    """

    seed: int
    step: int
    samples: tuple[int, ...]

    @classmethod
    def for_batch(cls, seed: int, step: int, samples: Sequence[int]) -> SampleRandom:
        return cls(int(seed), int(step), tuple(int(s) for s in samples))

    def key(self, sample: int, stream: str) -> int:
        """The key of one sample's draws in ``stream`` (``"noise"``, ``"timestep"``, …)."""
        return mix_key(self.seed, self.step, sample, stream)

    def _stack(
        self, stream: str, shape: Sequence[int], draw: str, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = []
        for sample in self.samples:
            gen = keyed_generator(self.key(sample, stream))
            fn = torch.randn if draw == "randn" else torch.rand
            rows.append(fn(tuple(shape), generator=gen, dtype=torch.float32))
        if not rows:
            return torch.empty((0, *shape), dtype=dtype)
        return torch.stack(rows).to(dtype)

    def randn(
        self,
        stream: str,
        shape: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """Standard normal draws ``[B, *shape]`` (drawn in float32, then cast)."""
        return self._stack(stream, shape, "randn", dtype).to(device)

    def rand(
        self,
        stream: str,
        shape: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """Uniform draws in ``[0, 1)`` of shape ``[B, *shape]``."""
        return self._stack(stream, shape, "rand", dtype).to(device)

    def bernoulli(self, stream: str, p: float, device: str | torch.device = "cpu") -> torch.Tensor:
        """One boolean per sample, ``True`` with probability ``p``: ``[B]``."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"bernoulli probability must be in [0, 1], got {p}")
        return self.rand(stream, device=device) < p

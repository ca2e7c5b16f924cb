"""The CUDA allocator's peak over a piece of work, the one way every measurement here takes it.

The benchmark's traced step, ``scripts/bench_kernel_device.py`` and
``scripts/protein_memory.py`` all ask the same question: how many bytes of tensors were live at
most while this ran, and how many of them were there before it? ::

    with CudaPeak(device) as peak:
        work()
    peak.added_bytes   # the peak above what was allocated at the start (None without CUDA)

On the CPU, or where CUDA was never initialised in the process (nothing could have been
allocated there), every figure is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import torch

__all__ = ["CudaPeak"]


@dataclass
class CudaPeak:
    """Measure the CUDA allocator over a ``with`` block on ``device`` (``None``: the current
    CUDA device; a CPU device: nothing is measured).

    Attributes (bytes, ``None`` when nothing was measured):
        before_bytes: allocated when the block began (weights, inputs, anything live).
        peak_bytes: the most allocated at once during the block, ``before_bytes`` included
            (``torch.cuda.max_memory_allocated``).
        reserved_bytes: the most the caching allocator held from the driver during the block
            (``torch.cuda.max_memory_reserved``): the tensors plus its cached blocks.
    """

    device: torch.device | str | None = None
    before_bytes: int | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def measuring(self) -> bool:
        """Whether this block is measured: a CUDA device (or none named) in a process where
        CUDA is initialised."""
        device = None if self.device is None else torch.device(self.device)
        return (device is None or device.type == "cuda") and torch.cuda.is_initialized()

    @property
    def added_bytes(self) -> int | None:
        """The peak above what was allocated at the start: what the block itself added."""
        if self.peak_bytes is None or self.before_bytes is None:
            return None
        return self.peak_bytes - self.before_bytes

    def __enter__(self) -> CudaPeak:
        if self.measuring:
            torch.cuda.synchronize(self.device)  # queued work belongs to what came before
            self.before_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.before_bytes is not None and kind is None:  # a CUDA error stays the one raised
            torch.cuda.synchronize(self.device)  # the block's queued work is part of it
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)

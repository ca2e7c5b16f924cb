"""``CudaPeak``: the CUDA allocator's peak over a block, on the CPU nothing, on CUDA a known
allocation measured to the byte."""

from __future__ import annotations

import pytest
import torch
from cuda_marks import CUDA

from dspzoo.core.device_memory import CudaPeak


def test_a_cpu_block_measures_nothing() -> None:
    with CudaPeak("cpu") as peak:
        torch.zeros(1000)
    assert not peak.measuring
    assert (peak.before_bytes, peak.peak_bytes, peak.reserved_bytes) == (None, None, None)
    assert peak.added_bytes is None


@CUDA
def test_a_cuda_block_measures_its_own_peak() -> None:
    device = torch.device("cuda")
    held = torch.zeros(1 << 20, device=device)  # 4 MiB live before the block
    with CudaPeak(device) as peak:
        temporary = torch.ones(1 << 22, device=device)  # 16 MiB, freed inside the block
        del temporary
        kept = torch.ones(1 << 18, device=device)  # 1 MiB, alive after it
    assert peak.before_bytes is not None and peak.before_bytes >= held.numel() * 4
    assert peak.added_bytes == pytest.approx(16 << 20, abs=1 << 20)  # allocator rounding
    assert peak.reserved_bytes is not None and peak.reserved_bytes >= peak.peak_bytes
    assert kept.is_cuda

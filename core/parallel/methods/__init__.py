"""Attention methods for sequence parallelism: blockwise pieces, ring, USP (and Ulysses, LSS)."""

from .blockwise import (
    block_attention,
    block_attention_backward,
    chunked_attention,
    merge,
)
from .lss import lss_attention
from .ring import (
    ring_attention,
    ring_positions,
    zigzag_gather,
    zigzag_lengths,
    zigzag_positions,
    zigzag_split,
)
from .ulysses import ulysses_attention
from .usp import usp_attention, usp_positions

__all__ = [
    "block_attention",
    "block_attention_backward",
    "chunked_attention",
    "lss_attention",
    "merge",
    "ring_attention",
    "ring_positions",
    "ulysses_attention",
    "usp_attention",
    "usp_positions",
    "zigzag_gather",
    "zigzag_lengths",
    "zigzag_positions",
    "zigzag_split",
]

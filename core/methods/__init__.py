"""Attention methods for sequence parallelism: blockwise pieces, ring, USP (and Ulysses, LSS)."""

from .blockwise import (
    block_attention,
    block_attention_backward,
    chunked_attention,
    merge,
)
from .lss import lss_attention
from .ulysses import ulysses_attention

__all__ = [
    "block_attention",
    "block_attention_backward",
    "chunked_attention",
    "lss_attention",
    "merge",
    "ulysses_attention",
]

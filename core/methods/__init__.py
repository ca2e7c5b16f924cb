"""Attention methods for sequence parallelism: blockwise pieces, ring, USP (and Ulysses, LSS)."""

from .blockwise import (
    block_attention,
    block_attention_backward,
    chunked_attention,
    merge,
)

__all__ = [
    "block_attention",
    "block_attention_backward",
    "chunked_attention",
    "merge",
]

"""dspzoo: multi-dimensional transformers under Dynamic Sequence Parallelism."""

__version__ = "0.1.0"

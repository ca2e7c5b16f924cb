"""dspzoo.core.strategies."""

"""dspzoo.core.layers."""

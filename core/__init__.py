"""dspzoo.core."""

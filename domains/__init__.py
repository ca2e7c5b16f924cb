"""dspzoo.domains."""

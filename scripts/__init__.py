"""dspzoo.scripts."""

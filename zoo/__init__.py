"""dspzoo.zoo."""

"""dspzoo.domains.video."""

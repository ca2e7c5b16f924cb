"""A minimal 2-D axial transformer: the smallest complete example of a dspzoo model."""

"""Worked examples: complete models written for the guides (``docs/new_architecture.md``)."""

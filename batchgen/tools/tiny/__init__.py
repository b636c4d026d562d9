"""Tiny checkpoints built offline, for tests and the sample run (`make_tiny_model`)."""

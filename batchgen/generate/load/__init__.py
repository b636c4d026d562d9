"""The checkpoints: loaded once, their adapters switched in place, the drafters."""

"""Tools around a run: `report` and `inspect`, `caption`'s job builder, the tiny checkpoints."""

"""Execution: the runner that wires the stages, and where rows run (here, or on Ray)."""

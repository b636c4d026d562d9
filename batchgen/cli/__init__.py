"""The command line: it owns the process (arguments, progress, signals, exit codes)."""

from .commands import main

__all__ = ["main"]

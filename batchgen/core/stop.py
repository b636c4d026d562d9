"""A stop request: the event that ends a run between batches, and what a hard exit must clean."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Stop"]


class Stop(threading.Event):
    """`set()` asks the run to stop; `cleanups` (newest last) are what the run holds that a
    process exiting at once would leave behind (the output lock, the temp folder)."""

    def __init__(self) -> None:
        super().__init__()
        self.cleanups: list[Callable[[], None]] = []

    def clean_up(self) -> None:
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

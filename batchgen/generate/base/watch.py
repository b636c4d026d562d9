"""What bounds one row's generation besides its max_tokens, as every lane's loop checks it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ...core.errors import StopRequested

__all__ = ["Watch"]


@dataclass(slots=True)
class Watch:
    """What bounds one row's generation besides max_tokens: the run's stop request, the
    row's deadline and the model's context (prompt plus completion)."""

    stop: threading.Event = field(default_factory=threading.Event)
    timeout: float | None = None  # seconds a row may take from its start: then finish reason "timeout"
    context: int | None = None  # prompt plus completion tokens the model takes

    def deadline(self, started: float) -> float:
        return started + self.timeout if self.timeout is not None else float("inf")

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise StopRequested

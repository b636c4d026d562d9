"""A server's parts put together: the store, the queue, and the app the CLI hands to uvicorn."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from ..core.errors import ConfigError
from .api import Guard, make_app
from .queue import Queue, ServeSettings
from .store import Store

__all__ = ["Service", "is_loopback"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class Service:
    store: Store
    queue: Queue
    app: Guard

    @classmethod
    def open(cls, data: Path, settings: ServeSettings, key: str | None) -> Service:
        """The settings checked as a run would check them (ConfigError), before anything is
        served; `key` None serves without one (the CLI allows it on loopback only)."""
        data.mkdir(parents=True, exist_ok=True)
        if settings.config(data / "check.jsonl", data / "check.parquet").stages:
            raise ConfigError("batchgen serve runs one-stage jobs: give it a preset without stages")
        if min(settings.max_file_bytes, settings.max_lines, settings.max_line_bytes) < 1:
            raise ConfigError("--max-file-bytes, --max-lines and --max-line-bytes must be >= 1")
        store = Store(data)
        queue = Queue(store, settings)
        app: FastAPI = make_app(store, queue, settings)
        return cls(store, queue, Guard(app, key))

    def close(self) -> None:
        self.queue.close()
        self.store.close()

"""Where rows run, behind one interface: the local executor and the Ray one take the same
settings, yield the same finished rows and report the same figures."""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.records import CacheStats, Finished, MediaStats, MemoryStats
from ..core.settings import RunConfig, WorkSettings
from ..generate.router import Engines
from ..output.resume import Pending

__all__ = ["Executor", "ExecutorStats"]


def _add(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in counts:
        for key, n in part.items():
            total[key] = total.get(key, 0) + n
    return total


@dataclass(slots=True)
class ExecutorStats:
    """An executor's figures so far: media work, prefix reuse, rows capped at the context, rows
    that could not batch (by reason), rows without media beside a column that looks like media."""

    media: MediaStats = field(default_factory=MediaStats)
    cache: CacheStats | None = None  # None: no prefix cache (--no-cache)
    max_tokens_capped: int = 0
    one_at_a_time: dict[str, int] = field(default_factory=dict)
    unused_media: dict[str, int] = field(default_factory=dict)
    near_misses: dict[str, int] = field(default_factory=dict)  # rows with a field one slip from ours
    memory: MemoryStats = field(default_factory=MemoryStats)

    @classmethod
    def added(cls, parts: list[ExecutorStats]) -> ExecutorStats:
        """Several executors' figures (Ray actors) as one run's: counts add, rates are recomputed."""
        caches = [p.cache for p in parts if p.cache is not None]
        return cls(
            MediaStats.added([p.media for p in parts]),
            CacheStats.added(caches) if caches else None,
            sum(p.max_tokens_capped for p in parts),
            _add([p.one_at_a_time for p in parts]),
            _add([p.unused_media for p in parts]),
            _add([p.near_misses for p in parts]),
            MemoryStats.added([p.memory for p in parts]),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ExecutorStats:
        cache, memory = value.get("cache"), dict(value.get("memory") or {})
        memory["widths"] = {int(w): n for w, n in (memory.get("widths") or {}).items()}  # JSON keys are text
        return cls(MediaStats(**value["media"]), CacheStats(**cache) if cache else None,
                   value["max_tokens_capped"], value["one_at_a_time"], value["unused_media"],
                   value.get("near_misses", {}), MemoryStats(**memory))  # fmt: skip


class Executor(ABC):
    """Pending rows in, finished rows out a list at a time, in the order they finish. A set
    `stop` ends the run between two lists (the caller commits what came out before). Every
    executor is made the same way; `engines` has inspected the models (none is loaded yet)."""

    def __init__(self, config: RunConfig, work: WorkSettings, engines: Engines, tmp_dir: Path,
                 stop: threading.Event):  # fmt: skip
        self.config, self.work, self.engines, self.tmp_dir, self.stop = config, work, engines, tmp_dir, stop

    @abstractmethod
    def run(self, todo: Pending) -> Generator[list[Finished], None, None]: ...

    @abstractmethod
    def stats(self) -> ExecutorStats: ...

    @abstractmethod
    def close(self) -> None:
        """Let go of what the executor holds (threads, a Ray instance)."""

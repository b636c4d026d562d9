"""Where rows run, behind one interface the local and the Ray executor share."""

from __future__ import annotations

import collections.abc
import dataclasses
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.figures import CacheStats, MediaStats, MemoryStats
from ..core.records import Finished
from ..core.settings import RunConfig, WorkSettings
from ..generate.generator import GenerationStats, Generator, GeneratorFactory
from ..media.resolve import Decoded
from ..output.pending import Pending

__all__ = ["Executor", "ExecutorStats", "Batches"]

# What an executor's run yields: finished rows a list at a time (closed when the run stops early).
Batches = collections.abc.Generator[list[Finished], None, None]


def _add(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in counts:
        for key, n in part.items():
            total[key] = total.get(key, 0) + n
    return total


# Generation's plain counts (capped rows, adapter switches, model loads, …): they add up as they are.
_COUNTS = tuple(f.name for f in dataclasses.fields(GenerationStats) if f.type in ("int", int))


@dataclass(slots=True, kw_only=True)
class ExecutorStats:
    """An executor's figures so far: media work, what generation did, rows without media beside
    a column that looks like media, rows with a field one slip from one of ours."""

    media: MediaStats = field(default_factory=MediaStats)
    generation: GenerationStats = field(default_factory=GenerationStats)
    unused_media: dict[str, int] = field(default_factory=dict)
    near_misses: dict[str, int] = field(default_factory=dict)

    @classmethod
    def added(cls, parts: list[ExecutorStats]) -> ExecutorStats:
        """Several executors' figures (Ray actors') as one run's: counts add, rates are recomputed."""
        gens = [p.generation for p in parts]
        caches = [g.cache for g in gens if g.cache is not None]
        generation = GenerationStats(
            cache=CacheStats.added(caches) if caches else None,
            one_at_a_time=_add([g.one_at_a_time for g in gens]),
            memory=MemoryStats.added([g.memory for g in gens]),
            **{name: sum(getattr(g, name) for g in gens) for name in _COUNTS},
        )
        return cls(
            media=MediaStats.added([p.media for p in parts]),
            generation=generation,
            unused_media=_add([p.unused_media for p in parts]),
            near_misses=_add([p.near_misses for p in parts]),
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ExecutorStats:
        gen = value["generation"]
        cache, memory = gen.get("cache"), dict(gen.get("memory") or {})
        memory["widths"] = {int(w): n for w, n in (memory.get("widths") or {}).items()}  # JSON keys are text
        generation = GenerationStats(
            cache=CacheStats(**cache) if cache else None,
            one_at_a_time=gen["one_at_a_time"],
            memory=MemoryStats(**memory),
            **{name: gen.get(name, 0) for name in _COUNTS},
        )
        media, unused, near = MediaStats(**value["media"]), value["unused_media"], value["near_misses"]
        return cls(media=media, generation=generation, unused_media=unused, near_misses=near)


class Executor(ABC):
    """Pending rows in, finished rows out a list at a time, in the order they finish. A set
    `stop` ends the run between two lists (the caller commits what came out before). Every
    executor is made the same way; `generator` makes the generator wherever rows run, and
    `decoded` holds the media decoded by earlier runs of the same caller (a local run's)."""

    def __init__(
        self,
        config: RunConfig,
        work: WorkSettings,
        tmp_dir: Path,
        stop: threading.Event,
        generator: GeneratorFactory = Generator,
        decoded: Decoded | None = None,
    ):
        self.config, self.work, self.tmp_dir, self.stop = config, work, tmp_dir, stop
        self.make_generator, self.decoded = generator, decoded
        self._start()

    @abstractmethod
    def _start(self) -> None:
        """What a kind of executor sets up once made (its models inspected, its pools started):
        a model that cannot be used stops the run here, before the output is touched."""

    @abstractmethod
    def run(self, todo: Pending) -> Batches: ...

    @abstractmethod
    def stats(self) -> ExecutorStats: ...

    @abstractmethod
    def close(self) -> None:
        """Let go of what the executor holds (threads, a Ray instance)."""

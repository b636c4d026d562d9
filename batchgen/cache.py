"""Content-keyed caches: `Memo` for media work across threads, `PrefixCache` for KV prefixes."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

__all__ = ["Memo", "PrefixCache"]

V = TypeVar("V")


class Memo(Generic[V]):
    """`get(key, compute)` returns the stored value, waits for a computation already under
    way, or computes. Failures are stored too, so a bad URL is tried once per run.

    Eviction: least recently used first, when the entry count passes `capacity` or the
    summed `weigh(value)` passes `max_weight`. The newest entry always stays.
    """

    def __init__(
        self, capacity: int = 1024, max_weight: int | None = None, weigh: Callable[[V], int] | None = None
    ):
        self.capacity = capacity
        self.max_weight = max_weight
        self.weigh = weigh or (lambda _: 0)
        self._done: OrderedDict[Hashable, tuple[Future, int]] = OrderedDict()
        self._pending: dict[Hashable, Future] = {}
        self._weight = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return self._done[key][0].result()
            if key in self._pending:
                self.hits += 1
                future = self._pending[key]
                owner = False
            else:
                self.misses += 1
                future = self._pending[key] = Future()
                owner = True
        if not owner:
            return future.result()
        try:
            value = compute()
            future.set_result(value)
            weight = self.weigh(value)
        except BaseException as e:
            future.set_exception(e)
            weight = 0
        with self._lock:
            del self._pending[key]
            self._done[key] = (future, weight)
            self._weight += weight
            self._evict()
        return future.result()

    def _evict(self) -> None:
        while len(self._done) > 1 and (
            len(self._done) > self.capacity
            or (self.max_weight is not None and self._weight > self.max_weight)
        ):
            _, (_, weight) = self._done.popitem(last=False)
            self._weight -= weight
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._done)


class PrefixCache:
    """Prompt-prefix KV snapshots keyed by content (prefix token ids + media digests).

    `get` hands out a deep copy, so decoding from it never touches the stored entry.
    Bounded LRU by entries and bytes; counts hits, misses, evictions and tokens saved.
    """

    def __init__(self, capacity: int = 50, max_bytes: int = 2 * 2**30):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.tokens_saved = 0

    @staticmethod
    def _nbytes(cache: list[Any]) -> int:
        return sum(getattr(c, "nbytes", 0) for c in cache)

    def longest(self, candidates: list[tuple[int, str]]) -> tuple[int, list[Any] | None]:
        """The longest stored prefix among `(length, key)` candidates, as a copy; one hit or
        one miss per call."""
        for length, key in sorted(candidates, reverse=True):
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                self.tokens_saved += length
                return length, copy.deepcopy(self._entries[key][0])
        self.misses += 1
        return 0, None

    def put(self, key: str, cache: list[Any]) -> None:
        if key in self._entries:
            return
        size = self._nbytes(cache)
        self._entries[key] = (cache, size)
        self._bytes += size
        while len(self._entries) > 1 and (len(self._entries) > self.capacity or self._bytes > self.max_bytes):
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
            self.evictions += 1

    def stats(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {
            "prefix_hits": self.hits,
            "prefix_misses": self.misses,
            "prefix_hit_rate": round(self.hits / lookups, 4) if lookups else 0.0,
            "prefix_evictions": self.evictions,
            "prompt_tokens_saved": self.tokens_saved,
        }

    def __len__(self) -> int:
        return len(self._entries)

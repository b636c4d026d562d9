"""`PrefixCache`: prompt-prefix KV snapshots, keyed by content, shared by the rows that begin alike."""

from __future__ import annotations

import copy
from collections import OrderedDict

from ...core.figures import CacheStats
from ..base.arrays import Cache

__all__ = ["PrefixCache"]


class PrefixCache:
    """Prompt-prefix KV snapshots keyed by content (prefix token ids + media digests).

    `get` hands out a deep copy, so decoding from it never touches the stored entry.
    Bounded LRU by entries and bytes; counts hits, misses, evictions and tokens saved.
    """

    def __init__(self, capacity: int = 50, max_bytes: int = 2 * 2**30):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Cache, int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.tokens_saved = 0

    @staticmethod
    def _nbytes(cache: Cache) -> int:
        return sum(getattr(c, "nbytes", 0) for c in cache)

    def longest(self, candidates: list[tuple[int, str]]) -> tuple[int, Cache | None]:
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

    def put(self, key: str, cache: Cache) -> None:
        if key in self._entries:
            return
        size = self._nbytes(cache)
        self._entries[key] = (cache, size)
        self._bytes += size
        self._evict(1)

    def _evict(self, keep: int) -> None:
        while len(self._entries) > keep and (
            len(self._entries) > self.capacity or self._bytes > self.max_bytes
        ):
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
            self.evictions += 1

    @property
    def held(self) -> int:
        """Bytes of the snapshots it keeps."""
        return self._bytes

    def shrink(self, max_bytes: int) -> None:
        """Keep at most this many bytes from now on (a memory budget making room for a row)."""
        self.max_bytes = min(self.max_bytes, max_bytes)
        self._evict(0)

    def recount(self) -> None:
        """Counts from zero for another run; the snapshots stay."""
        self.hits = self.misses = self.evictions = self.tokens_saved = 0

    def stats(self) -> CacheStats:
        lookups = self.hits + self.misses
        rate = round(self.hits / lookups, 4) if lookups else 0.0
        return CacheStats(
            prefix_hits=self.hits,
            prefix_misses=self.misses,
            prefix_hit_rate=rate,
            prefix_evictions=self.evictions,
            prompt_tokens_saved=self.tokens_saved,
        )

    def __len__(self) -> int:
        return len(self._entries)

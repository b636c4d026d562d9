"""The two caches: `Memo` (once per key across threads, failures kept, bounded) and
`PrefixCache` (longest prefix, copies out, bounded by entries and bytes)."""

from __future__ import annotations

import threading
import time

import pytest

from batchgen.core.memo import Memo
from batchgen.generate.decode.prefix_cache import PrefixCache


def test_memo_computes_once_while_threads_wait_and_keeps_failures():
    memo: Memo[int] = Memo()
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.1)
        return 42

    results = []
    threads = [threading.Thread(target=lambda: results.append(memo.get("k", slow))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 5 and len(calls) == 1 and (memo.hits, memo.misses) == (4, 1)

    def broken():
        calls.append(1)
        raise ValueError("bad")

    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            memo.get("bad", broken)
    assert len(calls) == 2  # the failure was computed once, then served


def test_memo_evicts_least_recently_used_by_count_and_weight():
    memo: Memo[str] = Memo(capacity=2)
    for key in "abc":
        memo.get(key, lambda k=key: k)
    memo.get("b", lambda: "again")  # a hit refreshes b
    assert len(memo) == 2 and memo.evictions == 1
    assert memo.get("a", lambda: "recomputed") == "recomputed"  # a was the oldest
    heavy: Memo[bytes] = Memo(capacity=100, max_weight=10, weigh=len)
    heavy.get(1, lambda: b"x" * 6)
    heavy.get(2, lambda: b"y" * 6)  # 12 > 10: the first goes
    assert len(heavy) == 1 and heavy.get(2, lambda: b"") == b"y" * 6
    heavy.get(3, lambda: b"z" * 50)  # the newest always stays, however heavy
    assert len(heavy) == 1


class Layer:
    def __init__(self, n: int):
        self.state = list(range(n))
        self.nbytes = n


def test_prefix_cache_finds_the_longest_prefix_and_hands_out_copies():
    cache = PrefixCache(capacity=10)
    cache.put("k4", [Layer(4)])
    cache.put("k9", [Layer(9)])
    length, found = cache.longest([(4, "k4"), (9, "k9"), (12, "k12")])
    assert length == 9 and found[0].state == list(range(9))
    found[0].state.append("changed")
    assert cache.longest([(9, "k9")])[1][0].state == list(range(9))  # the stored entry is intact
    assert cache.longest([(3, "nope")]) == (0, None)
    stats = cache.stats()
    assert (stats.prefix_hits, stats.prefix_misses, stats.prompt_tokens_saved) == (2, 1, 18)
    assert stats.prefix_hit_rate == 0.6667


def test_prefix_cache_is_bounded_by_entries_and_bytes():
    cache = PrefixCache(capacity=2, max_bytes=100)
    for i in range(3):
        cache.put(f"k{i}", [Layer(10)])
    assert len(cache) == 2 and cache.longest([(1, "k0")]) == (0, None)
    cache.put("big", [Layer(95)])
    assert len(cache) == 1 and cache.stats().prefix_evictions == 3

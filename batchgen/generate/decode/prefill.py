"""A row's prompt into its KV cache: from the longest cached prefix, or in the engine's chunks.

The longest cached prefix is a system prompt every row shares or an image every question on it
shares; snapshots are stored at the row's boundaries on the way, then the rows' tails are fed
together. With --kv-bits (and for a drafter's rows), every token but the last goes in the
engine's own chunks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ..base.arrays import Cache
from ..base.watch import Watch
from .adapters import Adapter, Sequence, embedded
from .batch_cache import KVQuant, merge_caches
from .memory import PREFILL_STEP
from .prefix_cache import PrefixCache

__all__ = ["prefill", "prefill_but_last", "feed_tails"]

_SHORT_TAIL = 32  # prompt tokens after the last boundary that go through with the last token


def prefill(
    adapter: Adapter, seq: Sequence, prefixes: PrefixCache | None, watch: Watch, kv: KVQuant | None = None
) -> tuple[Cache, int]:
    """Resume from the longest cached prefix and fill the row's cache up to its tail, storing
    the row's boundaries on the way; return the cache and where the tail starts. The tail,
    whose logits are wanted, is left for `feed_tails`, which feeds rows' tails together."""
    if kv is not None:
        return prefill_but_last(adapter, seq, watch, kv), len(seq.ids) - 1
    n = len(seq.ids)
    cache, start = None, 0
    if prefixes is not None and seq.boundaries:
        start, cache = prefixes.longest([(p, k) for p, k in seq.boundaries if 0 < p < n])
    cache = cache if cache is not None else adapter.make_cache()
    seq.cached_tokens = start
    stops = [(p, k) for p, k in seq.boundaries if start < p < n] if prefixes is not None else []
    # A long tail is filled without its logits (never evaluated, so MLX never computes the
    # vocabulary projection for it), then the last token gives them; a short tail (a question
    # after a cached image) goes in one forward pass: each pass has a fixed cost.
    last = max([start, *(p for p, _ in stops)])
    tail = [(n - 1, None)] if n - last > _SHORT_TAIL else []
    for end, key in [*stops, *tail]:
        while start < end:
            watch.check_stop()
            step_end = min(end, start + PREFILL_STEP)
            adapter.forward(seq, cache, start, step_end)
            mx.eval([c.state for c in cache])
            start = step_end
        if key is not None and prefixes is not None:  # keys come from the prefix cache's boundaries
            prefixes.put(key, copy.deepcopy(cache))
    return cache, start


def prefill_but_last(adapter: Adapter, seq: Sequence, watch: Watch, kv: KVQuant | None = None) -> Cache:
    """A row filled as mlx-lm's generate fills it: every token but the last, in its chunks; with
    `kv` (--kv-bits), the cache quantized after each chunk that leaves it `kv.start` tokens or
    more (where a later token attends to full-precision keys or quantized ones depends on these
    chunks, so no prefix snapshot splits them)."""
    cache, start, end = adapter.make_cache(), 0, len(seq.ids) - 1
    while start < end:
        watch.check_stop()
        step_end = min(end, start + PREFILL_STEP)
        adapter.forward(seq, cache, start, step_end)
        if kv is not None:
            kv.quantize(cache)
        mx.eval([c.state for c in cache])
        start = step_end
    return cache


def feed_tails(
    adapter: Adapter, seqs: list[Sequence], rows: list[tuple[int, Cache, int]]
) -> Iterator[tuple[list[int], mx.array, Cache]]:
    """The prefilled rows' tails, fed together where they can be: rows whose tails are as long
    and embedded alike (token ids, or plain embeddings) share one forward pass on their merged
    cache (each pass has a fixed cost). Yields (rows, their logits, their batch cache)."""
    groups: dict[tuple, list[tuple[int, Cache, int, Any]]] = {}
    for i, cache, a in rows:
        embeds, extra = embedded(seqs[i], a, len(seqs[i].ids))
        key = (len(seqs[i].ids) - a, embeds is None) if not extra else ("alone", i)
        groups.setdefault(key, []).append((i, cache, a, embeds))
    for group in groups.values():
        ids = [i for i, *_ in group]
        if len(group) == 1:
            i, cache, a, _ = group[0]
            logits = adapter.forward(seqs[i], cache, a, len(seqs[i].ids))
            mx.eval(logits)
            yield ids, logits, merge_caches([cache])
            continue
        merged = merge_caches([cache for _, cache, _, _ in group])
        logits = adapter.forward_batch(
            [seqs[i] for i in ids], merged, [a for *_, a, _ in group], [e for *_, e in group]
        )
        mx.eval(logits)
        yield ids, logits, merged

"""`Memo`, content-keyed and bounded, shared by threads; `PerObject`, held while its object lives."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["Memo", "PerObject"]

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

    @property
    def held(self) -> int:
        """The summed weight of what it keeps."""
        return self._weight

    def shrink(self, max_weight: int) -> None:
        """Keep at most this weight from now on (a memory budget making room); the newest stays."""
        with self._lock:
            self.max_weight = min(self.max_weight, max_weight) if self.max_weight is not None else max_weight
            self._evict()

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


class PerObject(Generic[V]):
    """`get(obj, compute)`: what `compute()` made for this very object, made once while it
    lives (a model's measured KV footprint and its weights' bytes).
    An entry holds the object weakly and goes when it does, so a later object that Python puts
    at a freed one's address never finds the old value; objects that cannot be dict keys (an
    MLX model is a dict) are held the same way."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, V]] = {}
        self._lock = threading.RLock()  # a death's callback may come while this thread holds it

    def get(self, obj: object, compute: Callable[[], V]) -> V:
        with self._lock:
            entry = self._known.get(id(obj))
            if entry is not None and entry[0]() is obj:
                return entry[1]
            value = compute()
            self._known[id(obj)] = (weakref.ref(obj, self._forget), value)
            return value

    def _forget(self, gone: weakref.ref) -> None:
        """An object died: its entry goes (unless a later object at its address has one now)."""
        with self._lock:
            for key, (ref, _) in list(self._known.items()):
                if ref is gone:
                    del self._known[key]

    def __len__(self) -> int:
        return len(self._known)

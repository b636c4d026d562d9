"""PerObject: what is worked out for an object is its own, and goes with it."""

from __future__ import annotations

import gc

from batchgen.core.memo import PerObject


class Tokenizer:
    """Stands for a tokenizer: an object whose id a later one may take."""


def test_an_objects_value_is_made_once_and_never_handed_to_a_later_object_at_its_address():
    memo: PerObject[str] = PerObject()
    calls = []
    first = Tokenizer()
    assert memo.get(first, lambda: calls.append(1) or "first's markers") == "first's markers"
    assert memo.get(first, lambda: calls.append(1) or "again") == "first's markers"
    assert calls == [1]
    address = id(first)
    del first
    gc.collect()
    assert len(memo) == 0  # the entry went with its object
    # CPython hands a freed address to a later object of the same size: that one is a new key.
    later = [Tokenizer() for _ in range(256)]
    reused = next((t for t in later if id(t) == address), None)
    if reused is not None:
        assert memo.get(reused, lambda: "its own") == "its own"
    assert memo.get(later[-1], lambda: "the last one's") == "the last one's"

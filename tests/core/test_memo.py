"""PerObject: what is worked out for an object is its own, and goes with it."""

from __future__ import annotations

import ast
import gc

from conftest import ROOT

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


class Model(dict):
    """Stands for an MLX model: a dict, so no dict key, and its id free for a later one."""


def test_an_object_that_cannot_be_a_key_gets_its_own_entry_and_it_goes_with_it():
    memo: PerObject[str] = PerObject()
    first = Model()
    assert memo.get(first, lambda: "first's footprint") == "first's footprint"
    assert memo.get(first, lambda: "again") == "first's footprint"
    del first
    gc.collect()
    assert len(memo) == 0
    later = [Model() for _ in range(256)]
    assert all(memo.get(m, lambda m=m: f"own {id(m)}") == f"own {id(m)}" for m in later)
    assert len(memo) == 256  # a later model at the freed address got its own, not the first's


def test_no_code_in_the_package_keys_anything_on_id():
    """Identity is PerObject's business alone (it holds the object weakly): an id() elsewhere
    is a memo or a key that a later object at a freed address would match."""
    calls = []
    for path in sorted((ROOT / "batchgen").rglob("*.py")):
        if path.name == "memo.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []

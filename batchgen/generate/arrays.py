"""MLX values as the Python ones the code reads from them. `array.tolist()` and `.item()` are
typed as any nesting of any number, `tree_flatten` as a list or a dict, `mlx_lm.load` as a
pair or a triple: these say which one each call site gets, at no cost (no copy, no check)."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

__all__ = ["ints", "floats", "int_rows", "float_rows", "scalar", "parameters", "load_lm"]


def ints(a: mx.array) -> list[int]:
    """A 1-d integer array's values."""
    return cast(list[int], a.tolist())


def floats(a: mx.array) -> list[float]:
    """A 1-d float array's values."""
    return cast(list[float], a.tolist())


def int_rows(a: mx.array) -> list[list[int]]:
    """A 2-d integer array's rows."""
    return cast(list[list[int]], a.tolist())


def float_rows(a: mx.array) -> list[list[float]]:
    """A 2-d float array's rows."""
    return cast(list[list[float]], a.tolist())


def scalar(a: mx.array) -> int:
    """A one-element integer array's value (a token id)."""
    return cast(int, a.item())


def parameters(model: Any) -> list[tuple[str, mx.array]]:
    """A model's weights by their dotted names."""
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def load_lm(path: str, lazy: bool = False) -> tuple[Any, Any]:
    """mlx-lm's `load` of a checkpoint folder: (model, tokenizer)."""
    import mlx_lm

    return cast(tuple[Any, Any], mlx_lm.load(path, lazy=lazy))

"""MLX values as the Python ones the code reads from them.

`array.tolist()` and `.item()` are typed as any nesting of any number, `tree_flatten` as a list
or a dict, `mlx_lm.load` as a pair or a triple: these say which one each call site gets, at no
cost (no copy, no check). And the engines' own objects, which neither engine types, named once
with what they are.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

__all__ = [
    "ints",
    "floats",
    "int_rows",
    "float_rows",
    "scalar",
    "parameters",
    "load_lm",
    "Model",
    "Cache",
    "CacheLayer",
    "Tokenizer",
    "Processor",
    "TemplateOwner",
    "ModelConfig",
]

# The engines type none of these (their attributes differ by family): the one place they are Any.
Model = Any  # an mlx-lm or mlx-vlm model: an mlx.nn.Module of its family
Tokenizer = Any  # mlx-lm's TokenizerWrapper, or the tokenizer inside an mlx-vlm processor
Processor = Any  # an mlx-vlm processor (transformers' ProcessorMixin, its tokenizer inside)
TemplateOwner = Any  # a Tokenizer or a Processor: whichever holds the chat template
ModelConfig = Any  # a model's config: mlx-vlm's ModelConfig or mlx-lm's ModelArgs
CacheLayer = Any  # one layer's: KVCache, RotatingKVCache, ArraysCache, their Batch* forms, …
Cache = list[CacheLayer]


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


def parameters(model: Model) -> list[tuple[str, mx.array]]:
    """A model's weights by their dotted names."""
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def safetensors(path: str) -> dict[str, mx.array]:
    """A .safetensors file's tensors by name."""
    return cast(dict[str, mx.array], mx.load(path))


def load_lm(path: str, lazy: bool = False, adapter: str | None = None) -> tuple[Model, Tokenizer]:
    """mlx-lm's `load` of a checkpoint folder, with its LoRA adapter: (model, tokenizer)."""
    import mlx_lm

    return cast(tuple[Model, Tokenizer], mlx_lm.load(path, lazy=lazy, adapter_path=adapter))

"""The batch KV cache as the decoder keeps it: rows' caches merged into one left-padded batch
cache per layer, a joining row written into a free slot in place, and the columns no running
row attends to cut away."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache as LMBatchKVCache
from mlx_vlm.models.cache import BatchKVCache as VLMBatchKVCache

from .adapters import Cache, CacheLayer

__all__ = ["SLOT_CACHES", "merge_caches", "in_place", "write_slots", "trim_layer"]


def merge_caches(caches: list[Cache]) -> Cache:
    """Per-row KV caches → one left-padded batch cache per layer."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]


SLOT_CACHES = (LMBatchKVCache, VLMBatchKVCache)  # batch caches a row can be written into in place


def in_place(layer: CacheLayer, more: CacheLayer) -> bool:
    return all(isinstance(c, SLOT_CACHES) and c.keys is not None for c in (layer, more))


def write_slots(layer: CacheLayer, more: CacheLayer, rows: list[int], slots: list[int]) -> None:
    """Rows `rows` of the batch cache `more` written over rows `slots` of `layer`, right-aligned
    with its write position; the others are not copied, unless the joiner is the longer one
    (then every row gets room on the left)."""
    if more._idx > layer._idx:
        grow = more._idx - layer._idx
        pad = [(0, 0), (0, 0), (grow, 0), (0, 0)]
        layer.keys, layer.values = mx.pad(layer.keys, pad), mx.pad(layer.values, pad)
        layer.left_padding = layer.left_padding + grow
        layer._idx += grow
    shift, end = layer._idx - more._idx, layer._idx
    for j, s in zip(rows, slots, strict=True):
        layer.keys[s : s + 1, :, shift:end, :] = more.keys[j : j + 1, :, : more._idx, :]
        layer.values[s : s + 1, :, shift:end, :] = more.values[j : j + 1, :, : more._idx, :]
    at, of = mx.array(slots), mx.array(rows)
    layer.left_padding[at] = more.left_padding[of] + shift
    layer.offset[at] = more.offset[of]


def trim_layer(layer: CacheLayer, live: list[int]) -> None:
    """The columns left of every live row's padding cut (a view, no copy)."""
    padding = layer.left_padding.tolist()
    cut = min(min(padding[s] for s in live), layer._idx) if live else 0
    if cut > 0:
        layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
        layer._idx -= cut
        layer.left_padding = layer.left_padding - cut

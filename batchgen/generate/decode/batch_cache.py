"""The batch KV cache the decoder keeps (rows merged, joined, cut) and --kv-bits quantization.

Rows' caches are merged into one left-padded batch cache per layer, a joining row is written
into a free slot in place, and the columns no running row attends to are cut away. With --kv-
bits, rows' caches are quantized where mlx-lm's generate quantizes them and merged into mlx-
vlm's batch form of the quantized cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache as LMBatchKVCache
from mlx_lm.models.cache import QuantizedKVCache as LMQuantizedKVCache
from mlx_vlm.models.cache import BatchKVCache as VLMBatchKVCache
from mlx_vlm.models.cache import BatchQuantizedKVCache
from mlx_vlm.models.cache import QuantizedKVCache as VLMQuantizedKVCache

from ...core.errors import ConfigError
from ...core.settings import KV_GROUPS
from ..base.arrays import Cache, CacheLayer

__all__ = ["KVQuant", "SLOT_CACHES", "merge_caches", "in_place", "write_slots", "trim_layer", "drop_tails"]


@dataclass(frozen=True, slots=True)
class KVQuant:
    """--kv-bits: the KV cache quantized as the engines' own generate does it (`kv_bits`,
    `kv_group_size`, `quantized_kv_start`): mlx-lm's converts a layer's cache once a forward
    pass leaves it holding `start` tokens or more, after each prefill chunk and each step."""

    bits: int
    group_size: int = 64
    start: int = 0  # tokens kept in full precision before the cache is quantized

    def engine_kwargs(self) -> dict[str, int]:
        return {"kv_bits": self.bits, "kv_group_size": self.group_size, "quantized_kv_start": self.start}

    def check(self, name: str, head_dim: int | None) -> None:
        """A group size that does not divide the model's head dim fails every row: said once."""
        if not head_dim or head_dim % self.group_size == 0:
            return
        fits = [str(g) for g in KV_GROUPS if head_dim % g == 0]
        hint = f"--kv-group-size {' or '.join(fits)} does" if fits else "no MLX group size does: no --kv-bits"
        raise ConfigError(
            f"--kv-group-size {self.group_size}: model {name!r} has {head_dim}-dim attention heads, "
            f"which the groups must divide ({hint})"
        )

    def check_cache(self, name: str, cache: Cache) -> None:
        """A model whose cache mlx cannot quantize (sliding-window layers: its RotatingKVCache
        has no quantized form) would fail every row: said once, at its first row."""
        try:
            self.quantized(cache)
        except NotImplementedError as e:
            raise ConfigError(
                f"--kv-bits {self.bits}: model {name!r} keeps a cache MLX cannot quantize ({e}: "
                "sliding-window attention layers); run it without --kv-bits"
            ) from e

    def fate(self, prompt: int, max_tokens: int) -> Literal["quantized", "full", "crosses"]:
        """Where a row's cache is quantized: `quantized` before its last prompt token goes in
        (the prefill's last chunk ends at `start` or later), so it decodes quantized from its
        first token; `full` if never before its last token's logits are made; `crosses` if in
        the middle of its decoding, which a batch cache of one kind cannot follow."""
        if prompt - 1 >= max(self.start, 1):
            return "quantized"
        if self.start >= prompt + max_tokens - 1:
            return "full"
        return "crosses"

    def quantized(self, cache: Cache) -> Cache:
        """Every layer that can be, in the quantized form (a fresh cache's, to measure a row)."""
        kw = {"group_size": self.group_size, "bits": self.bits}
        return [c.to_quantized(**kw) if hasattr(c, "to_quantized") else c for c in cache]

    def quantize(self, cache: Cache) -> None:
        """mlx-lm's `maybe_quantize_kv_cache`, on one row's cache, in place."""
        for i, c in enumerate(cache):
            if hasattr(c, "to_quantized") and c.offset >= self.start:
                cache[i] = c.to_quantized(group_size=self.group_size, bits=self.bits)


QUANTIZED = (LMQuantizedKVCache, VLMQuantizedKVCache)  # one row's quantized cache, either engine's


def merge_caches(caches: list[Cache]) -> Cache:
    """Per-row KV caches → one left-padded batch cache per layer."""
    out = []
    for layer in zip(*caches, strict=True):
        merge = _merge_quantized if isinstance(layer[0], QUANTIZED) else type(layer[0]).merge
        out.append(merge(list(layer)))
    return out


def _merge_quantized(caches: list[Any]) -> BatchQuantizedKVCache:
    """Rows' quantized caches → mlx-vlm's batch form, left-padded as mlx-lm's BatchKVCache.merge
    pads full ones: the packed values, scales and biases copied as they are."""
    lengths = [c.offset for c in caches]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    first = caches[0]
    batch: Any = BatchQuantizedKVCache(padding, group_size=first.group_size, bits=first.bits)
    if longest == 0:
        return batch

    def stacked(parts: list[tuple[mx.array, ...] | None]) -> tuple[mx.array, ...]:
        ref = next(part for part in parts if part is not None)
        out = []
        for k, like in enumerate(ref):
            whole = mx.zeros((len(parts), like.shape[1], longest, like.shape[3]), dtype=like.dtype)
            for i, (part, p, n) in enumerate(zip(parts, padding, lengths, strict=True)):
                if part is not None and n:
                    whole[i : i + 1, :, p:] = part[k][..., :n, :]
            out.append(whole)
        return tuple(out)

    batch.keys, batch.values = stacked([c.keys for c in caches]), stacked([c.values for c in caches])
    batch.offset = mx.array(lengths)
    batch._idx = longest
    return batch


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


def drop_tails(layer: CacheLayer, drop: list[int]) -> None:
    """Each row's last `drop[r]` entries cut (a speculative round's rejected drafts, as many as
    the row rejected): the row's entries rolled right by that much within the written columns,
    the cut ones now left of its padding, where no query attends."""
    if not any(drop):
        return
    if len(set(drop)) == 1:  # every row rejected as many: the write position moves back, no copy
        layer.trim(drop[0])
        return
    n, shift = layer._idx, mx.array(drop)
    source = ((mx.arange(n)[None, :] - shift[:, None]) % n)[:, None, :, None]
    layer.keys[..., :n, :] = mx.take_along_axis(layer.keys[..., :n, :], source, axis=2)
    layer.values[..., :n, :] = mx.take_along_axis(layer.values[..., :n, :], source, axis=2)
    layer.left_padding = layer.left_padding + shift
    layer.offset = layer.offset - shift

"""What a run may hold in memory, and which rows fit one decode batch under it.

The budget (`--memory-budget`) is the whole run's: the weights are counted once, and what is
left holds the batch's KV cache, its transient activations and the prefix and image caches.
A model's KV cache per row is measured, not guessed from config names that differ per family:
one token through the model on a fresh cache shows each layer's kind (full attention, a sliding
window, a fixed linear-attention state), its bytes per token and its dtype (a quantized
checkpoint's caches are not quantized). A batch's cache is left-padded to its longest row and
grows 256 tokens at a time by a copy; rows joining it are prefilled into caches of their own
that live until the merged one is computed at the next step. So a batch of n rows holds up to
3 · n · the longest row's cache for a moment (measured on the CPU backend: 73 MiB at its peak
for 31 short rows that hold 15 MiB once merged, weights 3 MiB).

An allocation failure is MLX's RuntimeError with its allocator's words (`[metal::malloc] …`,
`[malloc] Unable to allocate …`, CUDA's `out of memory`); `out_of_memory` tells it from others.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.utils import maybe_set_recommended_wired_limit

from ...core.budget import BudgetSpec, human_bytes
from ...core.errors import RowError
from ...core.figures import MemoryStats
from ...core.memo import PerObject
from ..base.arrays import Cache, CacheLayer, Model, parameters
from ..base.aside import at_home

__all__ = [
    "Footprint",
    "Memory",
    "PREFILL_STEP",
    "batch_need",
    "device_memory",
    "footprint",
    "out_of_memory",
    "weights_bytes",
    "wired",
]

CPU_SHARE = 0.6  # `auto` on the CPU backend: this share of RAM (media decoding and Python keep the rest)
COPIES = 3  # the joiners' own caches, the merged batch cache, and its grown copy
STEP = 256  # mlx's KV caches grow this many tokens at a time
PREFILL_STEP = 2048  # tokens per prefill forward (the decoder's): bounds activation memory on long prompts
LOWER = 0.75  # after an out-of-memory, the batch bytes that failed times this is the new ceiling
_OOM = re.compile(
    r"malloc\]|out of memory|outofmemory|insufficient memory|resource limit|unable to allocate", re.IGNORECASE
)


def out_of_memory(e: BaseException) -> bool:
    """An allocation failure raised by MLX (any backend), not a row's own fault."""
    return isinstance(e, (RuntimeError, MemoryError)) and bool(_OOM.search(str(e)[:2000]))


@contextmanager
def wired() -> Iterator[None]:
    """The wired-memory limit raised to the device's recommended working set while a batch
    decodes, as mlx-lm's generate raises it (the weights stay resident instead of paging: a
    near-limit model went from 0.23 to 4.7 tok/s, ml-explore/mlx-examples issue 1069), and put
    back on every way out, once the queued work is done; where the device recommends no size
    (the CPU backend) nothing changes."""
    old = maybe_set_recommended_wired_limit()
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize()
            mx.set_wired_limit(old)


def device_memory() -> tuple[int, str]:
    """The bytes `auto` budgets, and how they were found."""
    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001 - older MLX: no device_info on this backend
        pass
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available():
        info = {**metal.device_info(), **info}
        if info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"]), "Metal's recommended working set"
    for key in ("total_memory", "memory_size"):
        if mx.default_device() != mx.cpu and isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key] * 0.9), f"90% of the GPU's {human_bytes(info[key])} ({key})"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram * CPU_SHARE), f"{CPU_SHARE:.0%} of this machine's {human_bytes(ram)} of RAM (CPU backend)"


@dataclass(frozen=True, slots=True)
class Footprint:
    """One row on one model: its KV cache (bytes per token of the layers that keep every
    token, (window, bytes per token) of sliding-window layers, the fixed state of the others),
    and what its prefill and decode steps hold for a moment (from the config's widths)."""

    per_token: int
    windows: tuple[tuple[int, int], ...] = ()
    fixed: int = 0
    hidden: int = 0  # activations per prefill token: the residual stream and the MLP's width
    heads: int = 0  # attention scores of a prefill chunk: heads x chunk x prompt
    vocab: int = 0  # logits per decoding row

    def row(self, tokens: int) -> int:
        return self.per_token * tokens + sum(b * min(tokens, w) for w, b in self.windows) + self.fixed

    def prefill(self, prompt: int) -> int:
        """A prompt's prefill at its peak: one chunk's activations and its attention scores over
        the prompt in float32 (the CPU backend holds them whole: 85.6 MiB measured against
        82 estimated for a 2,000-token prompt on tiny-lm; a fused kernel holds less)."""
        chunk = min(prompt, PREFILL_STEP)
        return chunk * self.hidden * 4 + 4 * self.heads * chunk * prompt

    def decoding(self, rows: int) -> int:
        """A decode step's logits, in float32, as sampled and as processed."""
        return rows * self.vocab * 4 * 3


def _arrays(value: object) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _layer(c: CacheLayer, per: list[int], windows: list[tuple[int, int]], fixed: list[int]) -> None:
    if hasattr(c, "caches"):  # CacheList: a layer with several caches
        for inner in c.caches:
            _layer(inner, per, windows, fixed)
        return
    keys = _arrays(getattr(c, "keys", None))
    if keys:
        arrays = keys + _arrays(getattr(c, "values", None))
        length = max(keys[0].shape[2], 1)
        size = sum(a.nbytes for a in arrays) // length
        window = getattr(c, "max_size", None)
        if isinstance(window, int) and window > 0:
            windows.append((window, size))
        else:
            per.append(size)
        return
    fixed.append(sum(a.nbytes for a in _arrays(getattr(c, "state", None))))


def _config(model: Model, name: str) -> int:
    for owner in (getattr(model, "args", None), getattr(model, "config", None), model):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def footprint(model: Model, cache: Cache) -> Footprint | None:
    """The model's row footprint, its KV cache measured on `cache` (fresh, from the lane's own
    make_cache) after one token; None where the model will not run on a bare token."""
    try:
        out = model(mx.array([[0]]), cache=cache)
        logits = getattr(out, "logits", out)
        mx.eval(logits, [a for c in cache for a in _arrays(getattr(c, "state", None))])
    except Exception:  # noqa: BLE001 - such a lane's rows run without a memory bound
        return None
    per: list[int] = []
    windows: list[tuple[int, int]] = []
    fixed: list[int] = []
    for c in cache:
        _layer(c, per, windows, fixed)
    # the residual stream and its norms, q/k/v/o, and the MLP's gate, up and product
    hidden = 12 * _config(model, "hidden_size") + 3 * _config(model, "intermediate_size")
    heads = _config(model, "num_attention_heads")
    return Footprint(sum(per), tuple(windows), sum(fixed), hidden, heads, int(logits.shape[-1]))


def batch_need(fp: Footprint, lengths: list[int], prompt: int) -> int:
    """A batch's bytes as a row with this prompt joins it: every row's cache padded to the
    longest (and a step of growth), three times over, the joiner's prefill and the step's logits."""
    caches = COPIES * len(lengths) * fp.row(max(lengths) + STEP)
    return caches + fp.prefill(prompt) + fp.decoding(len(lengths))


def weights_bytes(model: Model) -> int:
    return sum(v.nbytes for _, v in parameters(model))


class Shrinking(Protocol):
    """A cache that may shrink for a row (prefix snapshots, processed images): the bytes it
    holds, and a way to hold at most so many."""

    @property
    def held(self) -> int: ...

    def shrink(self, most: int, /) -> None: ...


class Loaded(Protocol):
    """What the budget asks of the run's checkpoints (`load.loading.Models`): the models loaded
    so far, whose weights it counts, and the caches they keep that may shrink for a row."""

    def loaded(self) -> list[Model]: ...

    def caches(self) -> list[Shrinking]: ...


class Memory:
    """The run's budget over its loaded models and caches. `fits` decides a decode batch's
    width as rows join; `check_alone` refuses a row no batch could hold; `lower` follows an
    out-of-memory. Without a budget every row fits (only --batch-size bounds a batch)."""

    def __init__(self, spec: BudgetSpec | None, models: Loaded, prefixes: Shrinking | None = None):
        self.models, self.prefixes = models, prefixes
        self.stats = MemoryStats()
        self._footprints: PerObject[dict[Hashable, Footprint | None]] = PerObject()  # by model, by kind
        self._weights: PerObject[int] = PerObject()
        self._largest = 0  # the most KV bytes a batch was let hold since the last lowering
        if spec is not None:
            device, how = device_memory()
            if spec.size is not None:
                self.stats.budget, self.stats.how = spec.size, f"--memory-budget {spec.text}"
            else:
                share = spec.share if spec.share is not None else 1.0
                self.stats.budget = int(device * share)
                self.stats.how = how if spec.share is None else f"{spec.text} of {how}"

    @property
    def budget(self) -> int | None:
        return self.stats.budget

    def footprint(
        self, model: Model, make_cache: Callable[[], Cache], kind: Hashable = None
    ) -> Footprint | None:
        """The model's KV per row (measured once per `kind` of cache: full precision, or a
        quantization), its weights counted once."""
        if self.budget is None:
            return None
        measured = self._footprints.get(model, dict)
        if kind not in measured:
            at_home("measuring a row's memory on the model")  # a forward pass, which may build lazy state
            measured[kind] = footprint(model, make_cache())
        return measured[kind]

    def weights(self) -> int:
        loaded: list[Model] = []
        for model in self.models.loaded():  # one checkpoint may serve two lanes: counted once
            if not any(model is seen for seen in loaded):
                loaded.append(model)
        self.stats.weights = sum(self._weights.get(m, partial(weights_bytes, m)) for m in loaded)
        return self.stats.weights

    def caches(self) -> list[Shrinking]:
        """What may shrink for a row: prefix snapshots first, then processed images."""
        return [c for c in (self.prefixes, *self.models.caches()) if c is not None]

    def held(self) -> int:
        return sum(c.held for c in self.caches())

    def room(self) -> int:
        """KV bytes a batch may take now: the budget less weights and what the caches hold."""
        if self.budget is None:
            raise ValueError("no budget, no room to weigh")
        room = self.budget - self.weights() - self.held()
        return room if self.stats.ceiling is None else min(room, self.stats.ceiling)

    def check_alone(self, fp: Footprint | None, prompt: int, max_tokens: int) -> None:
        """A row that could not fit even alone, with the caches emptied: its error, before any work."""
        if fp is None or self.budget is None:
            return
        need = batch_need(fp, [prompt + max_tokens], prompt)
        free = self.budget - self.weights()
        if need > free:
            self.stats.too_big += 1
            raise RowError(
                "generate",
                f"too big for the memory budget even alone ({human_bytes(max(free, 0))} after the weights, "
                f"of {human_bytes(self.budget)} from {self.stats.how}); it needs {human_bytes(need)} for "
                f"{prompt} prompt tokens + max_tokens {max_tokens} (its KV cache as a batch holds it, and "
                "its prefill); lower max_tokens or raise --memory-budget",
            )

    def fits(self, fp: Footprint | None, lengths: list[int], prompt: int, alone: bool) -> bool:
        """Whether rows of these lengths (prompt + max_tokens) fit one batch as one with this
        prompt joins; a row `alone` always runs, the caches shrinking to make room for it."""
        if fp is None or self.budget is None:
            return True
        need = batch_need(fp, lengths, prompt)
        if need > self.room():
            if not alone:
                return False
            self._shrink(need)
        self._largest = max(self._largest, need)
        return True

    def _shrink(self, need: int) -> None:
        for c in self.caches():
            over = need - self.room()
            if over <= 0:
                return
            c.shrink(max(c.held - over, 0))

    def lower(self) -> None:
        """After an out-of-memory: batches get at most LOWER x the largest one let in so far."""
        self.stats.out_of_memory += 1
        if self._largest:
            self.stats.ceiling = int(self._largest * LOWER)
            self._largest = 0
        mx.clear_cache()

    def step(self, width: int) -> None:
        self.stats.widths[width] = self.stats.widths.get(width, 0) + 1

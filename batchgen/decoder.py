"""Batched generation with prompt-prefix reuse: the MLX core under engine.py.

Each row becomes a `Sequence`: its full prompt ids, a way to embed any slice of them, and
its positions. Rows are prefilled one at a time, resuming from the longest cached prefix
(a system prompt shared by every row, an image shared by every question on it); snapshots
are stored at the row's boundaries on the way. Then all rows of the batch decode together
in one left-padded KV cache, each with its own sampler, stop rules and positions.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .cache import PrefixCache
from .errors import StopRequested
from .records import GenParams

__all__ = [
    "Watch", "Sequence", "Adapter", "LMAdapter", "VLMAdapter", "decode_batch", "hit_stop", "final_text",
    "sampler_for", "logits_processors_for", "HISTORY",
]  # fmt: skip

PREFILL_STEP = 2048  # tokens per prefill forward: bounds activation memory on long prompts
# Logits processors (penalties) see the prompt and then the generated tokens, on every lane
# (mlx-lm's rule; single.py brings mlx-vlm's generate to it): its last HISTORY tokens, more
# than any penalty's own window.
HISTORY = 256


@dataclass(slots=True)
class Sequence:
    """One row inside the decoder; the outputs are filled in by `decode_batch`."""

    ids: list[int]
    params: GenParams
    boundaries: list[tuple[int, str]] = field(default_factory=list)  # (prefix length, cache key)
    embed: Callable[[int, int], mx.array] | None = None  # embeddings of ids[a:b] (media rows)
    positions: mx.array | None = None  # (3, 1, L) mRoPE positions of the prompt
    delta: int = 0  # mRoPE: position of generated token n is len(ids) + n + delta
    capped: bool = False  # max_tokens was lowered to fit the model's context
    # outputs
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    cached_tokens: int = 0
    text: str = ""


@dataclass(slots=True)
class Watch:
    """What bounds one row's generation besides max_tokens: the run's stop request, the
    row's deadline and the model's context (prompt plus completion)."""

    stop: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() past which rows end with finish reason "timeout"
    context: int | None = None  # prompt plus completion tokens the model takes

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise StopRequested


class Adapter:
    """How one model family runs a forward pass; subclasses differ only in inputs."""

    model: Any

    def make_cache(self) -> list[Any]:
        raise NotImplementedError

    def forward(self, seq: Sequence, cache: list[Any], a: int, b: int) -> mx.array:
        raise NotImplementedError

    def decode(self, tokens: mx.array, cache: list[Any], seqs: list[Sequence], step: int) -> mx.array:
        raise NotImplementedError


class LMAdapter(Adapter):
    """mlx-lm models: positions come from the cache offsets, batched or not."""

    def __init__(self, model: Any):
        self.model = model

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def forward(self, seq: Sequence, cache: list[Any], a: int, b: int) -> mx.array:
        return self.model(mx.array(seq.ids[a:b])[None], cache=cache)[:, -1]

    def decode(self, tokens: mx.array, cache: list[Any], seqs: list[Sequence], step: int) -> mx.array:
        return self.model(tokens[:, None], cache=cache)[:, -1]


class VLMAdapter(Adapter):
    """Qwen-VL language models: explicit 3-D (mRoPE) positions per row, media embeddings
    merged in by the caller's `embed`."""

    def __init__(self, model: Any):
        self.model = model
        self.lm = model.language_model

    def make_cache(self) -> list[Any]:
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.lm)

    def forward(self, seq: Sequence, cache: list[Any], a: int, b: int) -> mx.array:
        ids = mx.array(seq.ids[a:b])[None]
        embeds = seq.embed(a, b) if seq.embed is not None else None
        positions = seq.positions[:, :, a:b] if seq.positions is not None else None
        out = self.lm(ids, inputs_embeds=embeds, cache=cache, position_ids=positions)
        return out.logits[:, -1]

    def decode(self, tokens: mx.array, cache: list[Any], seqs: list[Sequence], step: int) -> mx.array:
        pos = mx.array([len(s.ids) + step + s.delta for s in seqs], dtype=mx.int32).reshape(1, -1, 1)
        positions = mx.broadcast_to(pos, (3, len(seqs), 1))
        return self.lm(tokens[:, None], cache=cache, position_ids=positions).logits[:, -1]


def _prefill(
    adapter: Adapter, seq: Sequence, prefixes: PrefixCache | None, watch: Watch
) -> tuple[mx.array, list[Any]]:
    """Resume from the longest cached prefix, store the row's boundaries, return last logits."""
    n = len(seq.ids)
    cache, start = None, 0
    if prefixes is not None and seq.boundaries:
        start, cache = prefixes.longest([(p, k) for p, k in seq.boundaries if 0 < p < n])
    cache = cache if cache is not None else adapter.make_cache()
    seq.cached_tokens = start
    stops = [(p, k) for p, k in seq.boundaries if start < p < n] if prefixes is not None else []
    # Everything but the last token only fills the cache: its logits are never evaluated,
    # so MLX never computes them (the vocabulary projection is a large share of a tiny model).
    for end, key in [*stops, (n - 1, None)]:
        while start < end:
            watch.check_stop()
            step_end = min(end, start + PREFILL_STEP)
            adapter.forward(seq, cache, start, step_end)
            mx.eval([c.state for c in cache])
            start = step_end
        if key is not None:
            prefixes.put(key, copy.deepcopy(cache))  # type: ignore[union-attr]
    logits = adapter.forward(seq, cache, start, n)
    mx.eval(logits)
    return logits, cache


def sampler_for(p: GenParams) -> Callable[[mx.array], mx.array] | None:
    if p.temperature == 0:
        return None
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(p.temperature, p.top_p if p.top_p < 1 else 0.0, p.min_p, top_k=p.top_k)


def logits_processors_for(p: GenParams) -> list[Callable]:
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        presence_penalty=p.presence_penalty or None,
    )


def hit_stop(tokens: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> bool:
    """Stop strings are looked for in a bounded tail of the text, not the whole of it."""
    longest = max(len(s) for s in stop)
    tail = decode(tokens[-(longest + 8) :])
    return any(s in tail for s in stop)


def final_text(
    tokens: list[int], eos: set[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]
) -> str:
    """The completion as text: without its end-of-turn token, cut before the first stop string."""
    text = decode(tokens[:-1] if tokens and tokens[-1] in eos else tokens)
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(hits)] if hits else text


def decode_batch(
    adapter: Adapter,
    seqs: list[Sequence],
    eos: set[int],
    decode: Callable[[list[int]], str],
    prefixes: PrefixCache | None = None,
    watch: Watch | None = None,
) -> None:
    """Generate every sequence of the batch; fills tokens, text, finish_reason, cached_tokens.

    A row with a seed and temperature > 0 must come alone: its draws then depend on nothing
    but its seed (the scheduler sees to that). Rows past the watch's deadline end with finish
    reason "timeout"; a stop request raises StopRequested between steps, whatever is running.
    """
    watch = watch or Watch()
    prefilled = [_prefill(adapter, s, prefixes, watch) for s in seqs]
    caches = [c for _, c in prefilled]
    if len(seqs) == 1 and seqs[0].params.seed is not None:
        mx.random.seed(seqs[0].params.seed)
    samplers = [sampler_for(s.params) for s in seqs]
    processors = [logits_processors_for(s.params) for s in seqs]
    batch_logits = mx.concatenate([logits for logits, _ in prefilled], axis=0)
    active = list(range(len(seqs)))
    merged = None
    step = 0
    while active:
        watch.check_stop()
        now = time.monotonic()
        rows = [seqs[i] for i in active]
        picked = []
        plain = all(samplers[i] is None and not processors[i] for i in active)
        if plain:
            picked = mx.argmax(batch_logits, axis=-1).tolist()
        else:
            for j, i in enumerate(active):
                row = batch_logits[j : j + 1]
                if processors[i]:
                    history = mx.array((seqs[i].ids + seqs[i].tokens)[-HISTORY:])
                    for proc in processors[i]:
                        row = proc(history, row)
                if samplers[i] is None:
                    picked.append(mx.argmax(row, axis=-1).item())
                else:
                    picked.append(samplers[i](row - mx.logsumexp(row, axis=-1, keepdims=True)).item())
        keep = []
        for j, (seq, token) in enumerate(zip(rows, picked, strict=True)):
            seq.tokens.append(token)
            if token in eos:
                seq.finish_reason = "stop"
            elif seq.params.stop and hit_stop(seq.tokens, seq.params.stop, decode):
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= seq.params.max_tokens:
                seq.finish_reason = "length"
            elif watch.deadline is not None and now > watch.deadline:
                seq.finish_reason = "timeout"
            else:
                keep.append(j)
        if not keep:
            break
        if merged is None:  # rows decode together from here on
            merged = _merge([caches[i] for i in active])
        if len(keep) < len(active):
            for c in merged:
                c.filter(keep)
            batch_tokens = mx.array([picked[j] for j in keep])
            active = [active[j] for j in keep]
        else:
            batch_tokens = mx.array(picked)
        batch_logits = adapter.decode(batch_tokens, merged, [seqs[i] for i in active], step)
        mx.eval(batch_logits)
        step += 1
    for seq in seqs:
        seq.text = final_text(seq.tokens, eos, seq.params.stop, decode)


def _merge(caches: list[list[Any]]) -> list[Any]:
    """Per-row KV caches → one left-padded batch cache per layer."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]

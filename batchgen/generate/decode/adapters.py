"""A row inside the decoder and how each model family runs a forward pass on it.

`Sequence` is one row: its prompt ids, a way to embed any slice of them, its positions and,
once decoded, its outputs. An `Adapter` feeds slices of sequences to one kind of model:
`LMAdapter` (mlx-lm: positions from the cache offsets), `VLMAdapter` (Qwen-VL: explicit
mRoPE positions, media embeddings merged by the lane), `OffsetVLMAdapter` (the other mlx-vlm
families). The decoder (decoder.py) drives them; lanes build the sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as lm_prompt_cache
from mlx_vlm.models.cache import make_prompt_cache as vlm_prompt_cache

from ...core.params import GenParams
from ..base.arrays import Cache, Model
from ..chat.reasoning import Part
from .sampling import Loops

__all__ = [
    "Sequence",
    "Adapter",
    "LMAdapter",
    "VLMAdapter",
    "OffsetVLMAdapter",
    "embedded",
]

# A row's (or a batch's) KV cache: one of the engines' cache objects per layer (KVCache,
# RotatingKVCache, ArraysCache, …), which share no base class batchgen could name.


@dataclass(slots=True)
class Sequence:
    """One row inside the decoder; the outputs are filled in by `decode_stream`."""

    ids: list[int]
    params: GenParams
    boundaries: list[tuple[int, str]] = field(default_factory=list)  # (prefix length, cache key)
    # embeddings of ids[a:b] (media rows), or (embeddings, more language-model kwargs)
    embed: Callable[[int, int], Any] | None = None
    positions: mx.array | None = None  # (3, 1, L) mRoPE positions of the prompt
    delta: int = 0  # mRoPE: position of generated token n is len(ids) + n + delta
    capped: bool = False  # max_tokens was lowered to fit the model's context
    loops: Loops | None = None  # with params.stop_repetition
    part: Part = "answer"  # a thinking model's part when decoding starts
    scored_after: list[int] | None = None  # a thinking row's prompt with thinking off: scores follow it
    drafted: int = 0  # a speculative row's tokens proposed by its drafter, and those accepted
    accepted: int = 0
    # outputs
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    cached_tokens: int = 0
    text: str = ""
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(
        default_factory=list
    )  # with params.logprobs


class Adapter:
    """How one model family runs a forward pass; subclasses differ only in inputs."""

    model: Model

    def make_cache(self) -> Cache:
        raise NotImplementedError

    def forward(self, seq: Sequence, cache: Cache, a: int, b: int) -> mx.array:
        raise NotImplementedError

    def decode(self, tokens: mx.array, cache: Cache, seqs: list[Sequence | None], ahead: int = 0) -> mx.array:
        """Logits after each row's last token, one row per slot (None: an idle slot, any
        position will do); `ahead`: the tokens fed were drawn but are not yet in `seq.tokens`
        (a pipelined step's), so each sits that much further on."""
        raise NotImplementedError

    def forward_batch(
        self, seqs: list[Sequence], cache: Cache, a: list[int], embeds: list[mx.array]
    ) -> mx.array:
        """Logits after each row's prompt, the rows' tails `ids[a:]` (all of one length) fed
        together on their merged cache; `embeds`: each tail's embeddings, or None."""
        raise NotImplementedError

    def continue_all(self, seq: Sequence, cache: Cache, tokens: mx.array) -> mx.array:
        """Logits at every position of `tokens` (k, L): k continuations of the row's whole
        prompt, fed together on k copies of its cache (answers scored teacher-forced)."""
        raise NotImplementedError


class LMAdapter(Adapter):
    """mlx-lm models: positions come from the cache offsets, batched or not."""

    def __init__(self, model: Model):
        self.model = model

    def make_cache(self) -> Cache:
        return lm_prompt_cache(self.model)

    def forward(self, seq: Sequence, cache: Cache, a: int, b: int) -> mx.array:
        return self.model(mx.array(seq.ids[a:b])[None], cache=cache)[:, -1]

    def decode(self, tokens: mx.array, cache: Cache, seqs: list[Sequence | None], ahead: int = 0) -> mx.array:
        return self.model(tokens[:, None], cache=cache)[:, -1]

    def forward_batch(
        self, seqs: list[Sequence], cache: Cache, a: list[int], embeds: list[mx.array]
    ) -> mx.array:
        return self.model(_tails(seqs, a), cache=cache)[:, -1]

    def continue_all(self, seq: Sequence, cache: Cache, tokens: mx.array) -> mx.array:
        return self.model(tokens, cache=cache)


def _positions(s: Sequence) -> mx.array:
    """A row's explicit (mRoPE) positions, which the lanes that need them always set."""
    if s.positions is None:
        raise ValueError("a row without its positions on a lane that needs them")
    return s.positions


def _tails(seqs: list[Sequence], a: list[int]) -> mx.array:
    return mx.array([s.ids[start:] for s, start in zip(seqs, a, strict=True)])


class VLMAdapter(Adapter):
    """Qwen-VL language models: explicit 3-D (mRoPE) positions per row, media embeddings
    merged in by the caller's `embed`."""

    def __init__(self, model: Model):
        self.model = model
        self.lm = model.language_model

    def make_cache(self) -> Cache:
        return vlm_prompt_cache(self.lm)

    def forward(self, seq: Sequence, cache: Cache, a: int, b: int) -> mx.array:
        ids = mx.array(seq.ids[a:b])[None]
        embeds, extra = embedded(seq, a, b)
        positions = seq.positions[:, :, a:b] if seq.positions is not None else None
        out = self.lm(ids, inputs_embeds=embeds, cache=cache, position_ids=positions, **extra)
        return out.logits[:, -1]

    def decode(self, tokens: mx.array, cache: Cache, seqs: list[Sequence | None], ahead: int = 0) -> mx.array:
        # the token fed is the row's last one: generated token n sits at len(ids) + n + delta
        at = [len(s.ids) + len(s.tokens) - 1 + ahead + s.delta if s is not None else 0 for s in seqs]
        positions = mx.broadcast_to(mx.array(at, dtype=mx.int32).reshape(1, -1, 1), (3, len(seqs), 1))
        return self.lm(tokens[:, None], cache=cache, position_ids=positions).logits[:, -1]

    def forward_batch(
        self, seqs: list[Sequence], cache: Cache, a: list[int], embeds: list[mx.array]
    ) -> mx.array:
        # mRoPE rows carry their positions (VLMAdapter's plans set them)
        positions = mx.concatenate(
            [_positions(s)[:, :, start:] for s, start in zip(seqs, a, strict=True)], axis=1
        )
        out = self.lm(_tails(seqs, a), inputs_embeds=_stacked(embeds), cache=cache, position_ids=positions)
        return out.logits[:, -1]

    def continue_all(self, seq: Sequence, cache: Cache, tokens: mx.array) -> mx.array:
        # continuation token j sits at len(ids) + j + delta, as generated tokens do
        k, n = tokens.shape
        pos = mx.arange(n, dtype=mx.int32) + len(seq.ids) + seq.delta
        positions = mx.broadcast_to(pos.reshape(1, 1, n), (3, k, n))
        return self.lm(tokens, cache=cache, position_ids=positions).logits


def _stacked(embeds: list[mx.array]) -> mx.array | None:
    return None if embeds[0] is None else mx.concatenate(embeds, axis=0)


def embedded(seq: Sequence, a: int, b: int) -> tuple[mx.array | None, dict[str, Any]]:
    """A slice's embeddings and what else the language model takes with them (Qwen3-VL's
    DeepStack features and their positions, for a slice holding media)."""
    out = seq.embed(a, b) if seq.embed is not None else None
    return out if isinstance(out, tuple) else (out, {})


class OffsetVLMAdapter(VLMAdapter):
    """mlx-vlm language models that take positions from the cache offsets (llava and most
    families but Qwen's): a slice holding media tokens gets the merged embeddings from the
    caller's `embed`, any other slice is embedded by the model itself."""

    def forward(self, seq: Sequence, cache: Cache, a: int, b: int) -> mx.array:
        embeds, extra = embedded(seq, a, b)
        return self.lm(mx.array(seq.ids[a:b])[None], inputs_embeds=embeds, cache=cache, **extra).logits[:, -1]

    def decode(self, tokens: mx.array, cache: Cache, seqs: list[Sequence | None], ahead: int = 0) -> mx.array:
        return self.lm(tokens[:, None], cache=cache).logits[:, -1]

    def forward_batch(
        self, seqs: list[Sequence], cache: Cache, a: list[int], embeds: list[mx.array]
    ) -> mx.array:
        return self.lm(_tails(seqs, a), inputs_embeds=_stacked(embeds), cache=cache).logits[:, -1]

    def continue_all(self, seq: Sequence, cache: Cache, tokens: mx.array) -> mx.array:
        return self.lm(tokens, cache=cache).logits

"""Constrained decoding: a row's constraint as a mask on each step's logits.

mlx-vlm's own llguidance processor applies its mask with a Metal kernel, which the CPU and
CUDA backends lack: the mask here is MLX array arithmetic, on any backend. A constraint is one
more logits processor: it sees each step's history, consumes the token sampled at the step
before, and masks what the grammar forbids next. When the grammar is complete only the end
token is allowed, so the row stops there.
"""

from __future__ import annotations

import json

import llguidance as llg
import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from ...core.constraints import LIMITS, TOOL_CALL_FORMAT, grammar
from ...core.params import Constraint
from ..base.arrays import scalar

__all__ = ["processor"]


def _term(tokenizer: llg.LLTokenizer, text: str) -> str:
    """A marker as a Lark term: a special token by its id (llguidance matches those by id,
    never by their text, as Qwen's `<tool_call>`), else its text."""
    ids = tokenizer.tokenize_str(text)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


class Masking:
    """The logits processor of one row's constraint (logits of one row, shape (1, vocab))."""

    def __init__(self, c: Constraint, guide: llg.LLTokenizer):
        self.llg = guide
        markers = (
            tuple(_term(self.llg, text) for text in TOOL_CALL_FORMAT[1:]) if c.kind == "tool_call" else None
        )
        self.matcher = llg.LLMatcher(self.llg, grammar(c, markers), log_level=0, limits=LIMITS)
        self.bits = np.zeros((1, (self.llg.vocab_size + 31) // 32), dtype=np.int32)
        self.steps = 0

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.steps:  # the token sampled at the previous step ends the history
            self.consume(scalar(history[-1]))
        self.steps += 1
        return self.masked(logits)

    def consume(self, token: int) -> None:
        """The grammar moves past a token of the answer."""
        self.matcher.consume_token(token)

    def masked(self, logits: mx.array, also: tuple[int, ...] = ()) -> mx.array:
        """What the grammar forbids next masked out; `also`: tokens let through besides (a
        reasoning block's first marker token, before the answer)."""
        fill_next_token_bitmask(self.matcher, self.bits, 0)
        allowed = np.unpackbits(self.bits.view(np.uint8), count=logits.shape[-1], bitorder="little")
        for token in also:
            allowed[token] = 1
        return mx.where(mx.array(allowed, dtype=mx.bool_), logits, -mx.inf)


def processor(c: Constraint, guide: llg.LLTokenizer) -> Masking:
    """A row's constraint as its mask, over llguidance's view of the vocabulary (`guide`, a
    model's `Traits.guide`: its end tokens allowed once the output is complete)."""
    return Masking(c, guide)

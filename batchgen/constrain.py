"""Constrained decoding: a row's JSON schema, regular expression or list of choices as a mask
on each step's logits, so its output is valid by construction.

The grammar engine is llguidance (installed with mlx-vlm): it compiles a schema in
microseconds, computes a step's mask lazily over the token trie in a few microseconds, and
handles every tokenizer batchgen loads. outlines-core compiles regexes to automata up front
(seconds for a large schema), xgrammar needs its own tokenizer info per model family; neither
is installed. mlx-vlm's own llguidance processor applies its mask with a Metal kernel, which
the CPU and CUDA backends lack: the mask here is MLX array arithmetic, on any backend.

A constraint is one more logits processor: it sees each step's history, consumes the token
sampled at the step before, and masks what the grammar forbids next. When the grammar is
complete only the end token is allowed, so the row stops there.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

import llguidance as llg
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from .records import Constraint

__all__ = ["KINDS", "LIMITS", "grammar", "check", "processor", "satisfied"]

KINDS = ("json_schema", "json_object", "regex", "choice")
_ANY_OBJECT = '{"type": "object"}'


# Bounds on what one row's constraint may cost before any generation: llguidance's own
# limits on the lexer and grammar it builds, and a cap on the spec itself (100,000 choices
# took seconds to compile in Lark, past any lexer fuel).
LIMITS = llg.LLParserLimits(initial_lexer_fuel=1_000_000, max_grammar_size=200_000)
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 10_000
MAX_COUNT = 100_000  # a schema's minItems / minLength / ... above this can never be generated
_COUNTS = ("minItems", "minLength", "minProperties", "minContains")


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes: with it a matcher reads any text, so whether
    a text satisfies its grammar is the grammar engine's answer, in linear time, and needs no
    model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_BYTES = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), slices=[])


@functools.lru_cache(maxsize=1024)  # rows share a few constraints; a hostile job's many stay bounded
def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint."""
    if c.json:  # compact JSON: free whitespace would let a model pad for ever
        compiler = llg.JsonCompiler(separators=(", ", ": "), whitespace_pattern="")
        return compiler.compile(c.spec if c.kind == "json_schema" else _ANY_OBJECT)
    return llg.grammar_from(c.kind, c.spec)


@functools.lru_cache(maxsize=1024)
def _matcher(c: Constraint) -> llg.LLMatcher:
    """A fresh byte-level matcher of the constraint, to be copied for each text it judges."""
    return llg.LLMatcher(_BYTES, grammar(c), log_level=0, limits=LIMITS)


def _first_line(message: str) -> str:
    """llguidance's reason in one short line: its `error:` line when it has one (the first
    line often quotes the whole spec)."""
    lines = message.strip().splitlines() or [""]
    return next((line for line in lines if line.startswith("error:")), lines[0])[:200]


@functools.lru_cache(maxsize=1024)
def check(c: Constraint) -> str | None:
    """Why the constraint cannot be used, or None: too large, rejected by llguidance in any
    way (with or without a message), no first step (a `$ref` loop), or asking for more
    items than any output could hold. Every check is bounded in time and size."""
    if len(c.spec) > MAX_SPEC_CHARS:
        return f"over {MAX_SPEC_CHARS:,} characters"
    try:
        if c.kind == "choice" and len(json.loads(c.spec)) > MAX_CHOICES:
            return f"over {MAX_CHOICES:,} choices"
        if c.kind == "json_schema" and (count := _huge_count(json.loads(c.spec))):
            return count
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar(c), _BYTES, limits=LIMITS)
        if is_error:
            return _first_line(messages[0] if messages else "") or "rejected by the grammar engine"
        matcher = _matcher(c).deep_copy()
        fill_next_token_bitmask(matcher, np.zeros((1, 9), dtype=np.int32), 0)  # a `$ref` loop fails here
        if matcher.is_error():  # e.g. a `$ref` that only refers to itself
            return f"no output can begin it ({_first_line(matcher.get_error())})"
    except Exception as e:  # noqa: BLE001 - a hostile spec may fail anywhere in the compiler
        return _first_line(f"{type(e).__name__}: {e}")
    return None


def _huge_count(schema: Any) -> str | None:
    """A `min*` count no output could reach, found by a walk over the (depth-bounded) schema."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in _COUNTS:
                value = node.get(key)
                if isinstance(value, (int, float)) and value > MAX_COUNT:
                    return f"{key} {value:g} is over {MAX_COUNT:,}"
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return None


_TOKENIZERS: dict[int, Any] = {}
_LOCK = threading.Lock()


def _llg_tokenizer(tokenizer: Any, eos: list[int]) -> Any:
    """llguidance's view of a tokenizer (a walk over the vocabulary: once per run and tokenizer)."""
    key = id(tokenizer)
    with _LOCK:
        if key not in _TOKENIZERS:
            # mlx-lm wraps the Hugging Face tokenizer (mlx-vlm's processors hold it as it is).
            hf = tokenizer._tokenizer if type(tokenizer).__name__ == "TokenizerWrapper" else tokenizer
            _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(hf, eos_token=eos))
        return _TOKENIZERS[key][1]


class _Masking:
    """The logits processor of one row's constraint (logits of one row, shape (1, vocab))."""

    def __init__(self, c: Constraint, tokenizer: Any, eos: list[int]):
        self.llg = _llg_tokenizer(tokenizer, eos)
        self.matcher = llg.LLMatcher(self.llg, grammar(c), log_level=0, limits=LIMITS)
        self.bits = np.zeros((1, (self.llg.vocab_size + 31) // 32), dtype=np.int32)
        self.steps = 0

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.steps:  # the token sampled at the previous step ends the history
            self.matcher.consume_token(history[-1].item())
        self.steps += 1
        fill_next_token_bitmask(self.matcher, self.bits, 0)
        allowed = np.unpackbits(self.bits.view(np.uint8), count=logits.shape[-1], bitorder="little")
        return mx.where(mx.array(allowed, dtype=mx.bool_), logits, -mx.inf)


def processor(c: Constraint, tokenizer: Any, eos: list[int]) -> _Masking:
    return _Masking(c, tokenizer, eos)


def satisfied(c: Constraint, text: str) -> tuple[str | None, str | None]:
    """(the output as canonical JSON for `parsed`, or None; why it does not satisfy the
    constraint, or None). The grammar guarantees validity when the row ran to its end; a row
    cut short by max_tokens or a stop string is caught here. The judge is the grammar engine
    reading the text byte by byte (linear time, never a backtracking matcher: a hostile
    regex or schema `pattern` cannot hang the run)."""
    matcher = _matcher(c).deep_copy()
    matcher.consume_tokens(list(text.encode("utf-8", "replace")))
    accepted = not matcher.is_error() and matcher.is_accepting()
    if c.kind == "choice":
        return None, None if accepted else "is not one of its choices"
    if c.kind == "regex":
        return None, None if accepted else "does not match its regex"
    try:
        value = json.loads(text)
        parsed = json.dumps(value)
    except (ValueError, RecursionError):
        return None, "is not complete JSON"
    if c.kind == "json_object" and not isinstance(value, dict):
        return None, "is not a JSON object"
    if not accepted:
        return None, "does not match its schema" if c.kind == "json_schema" else "is not a JSON object"
    return parsed, None

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

import json
import re
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from .records import Constraint

__all__ = ["KINDS", "grammar", "check", "processor", "satisfied"]

KINDS = ("json_schema", "json_object", "regex", "choice")
_ANY_OBJECT = '{"type": "object"}'


_GRAMMARS: dict[Constraint, str] = {}
_LOCK = threading.Lock()


def grammar(c: Constraint) -> str:
    """The llguidance grammar of a constraint (compiled once per run)."""
    with _LOCK:
        if c not in _GRAMMARS:
            import llguidance as llg

            if c.json:  # compact JSON: free whitespace would let a model pad for ever
                compiler = llg.JsonCompiler(separators=(", ", ": "), whitespace_pattern="")
                _GRAMMARS[c] = compiler.compile(c.spec if c.kind == "json_schema" else _ANY_OBJECT)
            else:
                _GRAMMARS[c] = llg.grammar_from(c.kind, c.spec)
        return _GRAMMARS[c]


def check(c: Constraint) -> str | None:
    """Why the constraint cannot be used (a schema llguidance cannot compile), or None."""
    import llguidance as llg

    try:
        ok, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar(c))
    except Exception as e:  # noqa: BLE001 - a hostile schema may fail anywhere in the compiler
        return f"{type(e).__name__}: {e}"
    return None if ok else "; ".join(messages)[:300]


_TOKENIZERS: dict[int, Any] = {}


def _llg_tokenizer(tokenizer: Any, eos: list[int]) -> Any:
    """llguidance's view of a tokenizer (a walk over the vocabulary: once per run and tokenizer)."""
    key = id(tokenizer)
    with _LOCK:
        if key not in _TOKENIZERS:
            import llguidance.hf

            # mlx-lm wraps the Hugging Face tokenizer (mlx-vlm's processors hold it as it is).
            hf = tokenizer._tokenizer if type(tokenizer).__name__ == "TokenizerWrapper" else tokenizer
            _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(hf, eos_token=eos))
        return _TOKENIZERS[key][1]


class _Masking:
    """The logits processor of one row's constraint (logits of one row, shape (1, vocab))."""

    def __init__(self, c: Constraint, tokenizer: Any, eos: list[int]):
        from llguidance import LLMatcher

        self.llg = _llg_tokenizer(tokenizer, eos)
        self.matcher = LLMatcher(self.llg, grammar(c))
        self.bits = np.zeros((1, (self.llg.vocab_size + 31) // 32), dtype=np.int32)
        self.steps = 0

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        from llguidance.numpy import fill_next_token_bitmask

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
    cut short by max_tokens or a stop string is caught here, and the schema is checked again
    with jsonschema when it is installed."""
    if c.kind == "choice":
        return None, None if text in json.loads(c.spec) else "is not one of its choices"
    if c.kind == "regex":
        try:
            return None, None if re.fullmatch(c.spec, text) else "does not match its regex"
        except re.error:  # a Rust-only regex: the grammar is the judge
            return None, None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None, "is not complete JSON"
    if c.kind == "json_object":
        return (json.dumps(value), None) if isinstance(value, dict) else (None, "is not a JSON object")
    validator = _validator(c)
    error = next(iter(validator.iter_errors(value)), None) if validator is not None else None
    if error is not None:
        return None, f"does not match its schema ({error.message[:120]})"
    return json.dumps(value), None


_VALIDATORS: dict[Constraint, Any] = {}


def _validator(c: Constraint) -> Any:
    """A jsonschema validator per schema, built once (building one per row cost more than the
    row's masks); None when jsonschema is missing or reads the schema otherwise than llguidance."""
    with _LOCK:
        if c not in _VALIDATORS:
            try:
                import jsonschema

                schema = json.loads(c.spec)
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
                _VALIDATORS[c] = cls(schema)
            except Exception:  # noqa: BLE001 - ImportError, SchemaError: llguidance is the judge
                _VALIDATORS[c] = None
        return _VALIDATORS[c]

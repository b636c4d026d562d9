"""Output constraints as rows and runs give them, checked once, and llguidance's verdict on an answer.

The grammar engine is llguidance (installed with mlx-vlm): it compiles a schema in
microseconds, handles every tokenizer batchgen loads, and knows whether a text is accepted
without any backtracking matcher; the masks it computes during decoding live with the
decoder (generate/chat/constrain.py).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from .answers import answer_kinds
from .params import Constraint, GenParams, tool_problems
from .rules import Problem

__all__ = [
    "KINDS",
    "LIMITS",
    "TOOL_CALL_FORMAT",
    "CONSTRAINT_FIELDS",
    "tool_constraint",
    "with_tool_choice",
    "constraint_of",
    "closed",
    "grammar",
    "check",
    "satisfied",
    "requested_kinds",
]

KINDS = ("json_schema", "json_object", "regex", "choice", "tool_call")

# The JSON tool-call format (Hermes', Qwen's; mlx-lm's `json_tools` parser): one call is
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A `tool_call` constraint is
# that text, its arguments those of one of the row's functions.
TOOL_CALL_FORMAT = ("json_tools", "<tool_call>", "</tool_call>")


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


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say
    otherwise: properties a schema does not name are not generated (xgrammar's, outlines' and
    vLLM's rule; llguidance's own default lets a model invent keys until max_tokens)."""
    schema = copy.deepcopy(schema)
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
        if is_object and "additionalProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo.extend(node[key].values())
        for key in _SCHEMA_ONE:
            todo.append(node.get(key))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo.extend(node[key])
        if isinstance(node.get("additionalProperties"), dict):
            todo.append(node["additionalProperties"])
    return schema


_COMPACT = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "whitespace_pattern": "",
}


@functools.lru_cache(maxsize=1024)  # rows share a few constraints; a hostile job's many stay bounded
def grammar(c: Constraint, markers: tuple[str, str] | None = None) -> str:
    """The llguidance grammar of a constraint; `markers`: a tool call's start and end as Lark
    terms (a tokenizer's special token is `<[id]>`; by default their text)."""
    if c.json:  # compact JSON: free whitespace would let a model pad for ever
        compiler = llg.JsonCompiler(separators=(", ", ": "), whitespace_pattern="")
        return compiler.compile(
            json.dumps(closed(json.loads(c.spec))) if c.kind == "json_schema" else _ANY_OBJECT
        )
    if c.kind == "tool_call":
        start, end = markers or (json.dumps(TOOL_CALL_FORMAT[1]), json.dumps(TOOL_CALL_FORMAT[2]))
        return _tool_grammar(json.loads(c.spec), (start, end))
    if c.kind not in ("regex", "choice"):
        raise ValueError(f"no grammar for a {c.kind} constraint")
    return llg.grammar_from("regex" if c.kind == "regex" else "choice", c.spec)


def tool_constraint(tools: tuple[dict[str, Any], ...], choice: str) -> Constraint | None:
    """A row's tool_choice as a constraint: `required` one call of any of its functions, a
    function's name a call of that one; None for auto and none."""
    if choice in ("auto", "none"):
        return None
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    spec = [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}} for f in chosen]
    return Constraint("tool_call", json.dumps(spec))


def with_tool_choice(
    p: GenParams, constraint: Constraint | None, problems: list[Problem]
) -> Constraint | None:
    """The row's constraint, or its tool_choice's (a call of a named function, or of any)."""
    found = tool_problems(p)
    problems += found
    tool = None if found else tool_constraint(p.tools, p.tool_choice)
    if tool is None:
        return constraint
    if constraint is not None:
        problems.append(
            (
                "tool_choice",
                f"{p.tool_choice!r} constrains the answer to a tool call: give it or "
                "an output constraint, not both",
            )
        )
        return None
    if why := check(tool):
        problems.append(("tools", f"the parameters cannot be compiled ({why})"))
        return None
    return tool


def _tool_grammar(functions: list[dict[str, object]], markers: tuple[str, str]) -> str:
    """One call in the JSON format, as Lark with a compact JSON schema per function."""
    alternatives = []
    for f in functions:
        schema = {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": closed(f["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": _COMPACT,
        }
        alternatives.append(f"%json {json.dumps(schema)}")
    lark = f'start: {markers[0]} "\\n" call "\\n" {markers[1]}\n'
    lark += "call: " + " | ".join(alternatives)
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


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


def _huge_count(schema: object) -> str | None:
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


def satisfied(c: Constraint, text: str, tool_calls: list | None = None) -> tuple[str | None, str | None]:
    """(the output as canonical JSON for `parsed`, or None; why it does not satisfy the
    constraint, or None). The grammar guarantees validity when the row ran to its end; a row
    cut short by max_tokens or a stop string is caught here. The judge is the grammar engine
    reading the text byte by byte (linear time, never a backtracking matcher: a hostile
    regex or schema `pattern` cannot hang the run); a tool call's, the model's parser (the
    text is then what was said besides the call)."""
    if c.kind == "tool_call":
        return None, None if tool_calls else "holds no complete tool call"
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


# Where a row asks for structured output: OpenAI's response_format, a JSON schema, or vLLM's
# guided_* names (plain `choice` or `regex` would take over columns of those names).
CONSTRAINT_FIELDS = ("response_format", "json_schema", "guided_json", "guided_choice", "guided_regex")


_SCHEMA_FIELDS = ("response_format", "json_schema", "guided_json")  # the fields that can name a schema


def requested_kinds(value: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """The answer columns of the JSON schema a row value asks for, found without compiling it:
    the job's scan takes them from every row before the first result is written."""
    if not any(value.get(n) is not None for n in _SCHEMA_FIELDS):
        return ()
    try:
        c = _requested(value, [])
    except (ValueError, TypeError, RecursionError):  # a value JSON cannot hold: the row's parse says so
        return ()
    return answer_kinds(c) if c is not None else ()


def constraint_of(value: dict[str, object], problems: list[Problem]) -> Constraint | None:
    """The row's output constraint, checked (a schema llguidance cannot compile is a problem)."""
    c = _requested(value, problems)
    if c is None:
        return None
    why = check(c)
    if why:
        name = next(n for n in CONSTRAINT_FIELDS if value.get(n) is not None)
        problems.append((name, f"cannot be compiled ({why})"))
        return None
    return c


def _requested(value: dict[str, object], problems: list[Problem]) -> Constraint | None:
    """The constraint a row value gives, as given (not yet compiled)."""
    given = [name for name in CONSTRAINT_FIELDS if value.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        problems.append((given[1], f"give one of {', '.join(given)}, not several"))
        return None
    name = given[0]
    spec = value[name]
    c: Constraint | None = None
    if name == "response_format":
        format_ = spec if isinstance(spec, dict) else {}
        kind, named = format_.get("type"), format_.get("json_schema")
        if kind == "text":
            return None
        if kind == "json_object":
            c = Constraint("json_object")
        elif kind == "json_schema" and isinstance(named, dict):
            schema = named.get("schema", {})
            c = Constraint("json_schema", json.dumps(schema)) if isinstance(schema, dict) else None
        if c is None:
            want = "{type: text | json_object | json_schema, json_schema: {schema}}"
            problems.append((name, f"expected {want}, got {spec!r:.60}"))
            return None
    elif name in ("json_schema", "guided_json"):
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                problems.append((name, f"not JSON ({e.msg})"))
                return None
        if not isinstance(spec, dict):
            problems.append((name, f"expected a JSON schema object, got {spec!r:.60}"))
            return None
        c = Constraint("json_schema", json.dumps(spec))
    elif name == "guided_choice":
        if not (isinstance(spec, list) and spec and all(isinstance(s, str) and s for s in spec)):
            problems.append((name, f"expected a list of non-empty strings, got {spec!r:.60}"))
            return None
        c = Constraint("choice", json.dumps(spec))
    else:
        if not (isinstance(spec, str) and spec):
            problems.append((name, f"expected a regular expression, got {spec!r:.60}"))
            return None
        c = Constraint("regex", spec)
    return c

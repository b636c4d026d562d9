"""The typed `answer.<field>` columns a JSON-schema row fills, decided before the first row.

Each top-level property's kind is found from the schema alone, and an output's columns are the
union over its rows' schemas, so every part and shard types them alike.
"""

from __future__ import annotations

import functools
import json

from .params import Constraint

__all__ = ["ANSWER_KINDS", "MAX_ANSWER_FIELDS", "MAX_ANSWER_COLUMNS", "answer_kinds", "merge_kinds"]

_SCALARS = ("string", "integer", "number", "boolean")
ANSWER_KINDS = (*_SCALARS, *(f"list<{k}>" for k in _SCALARS), "json")  # how an answer field is stored


MAX_ANSWER_FIELDS = 64  # a schema naming more top-level properties gets no answer columns
MAX_ANSWER_COLUMNS = 1024  # answer columns of one output, its schemas together: it stays a table


MAX_FIELD_NAME = 100


def _value_kind(values: list[object]) -> str:
    """The kind of an `enum` / `const`: one scalar type for all its values, else JSON."""
    kinds = {
        "boolean"
        if isinstance(v, bool)
        else "integer"
        if isinstance(v, int)
        else "number"
        if isinstance(v, float)
        else "string"
        if isinstance(v, str)
        else "json"
        for v in values
    }
    if kinds == {"integer", "number"}:
        return "number"
    return kinds.pop() if len(kinds) == 1 else "json"


def _kind(node: object, depth: int = 0) -> str:
    """How one property's values are stored: a scalar, a list of one scalar, or JSON text."""
    if not isinstance(node, dict) or depth > 2:
        return "json"
    kind = node.get("type")
    if isinstance(kind, list):  # ["string", "null"] is a string that may be missing
        rest = [k for k in kind if k != "null"]
        kind = rest[0] if len(rest) == 1 else None
    if kind is None:
        if isinstance(node.get("enum"), list) and node["enum"]:
            return _value_kind(node["enum"])
        if "const" in node:
            return _value_kind([node["const"]])
        branches = node.get("anyOf", node.get("oneOf"))
        if isinstance(branches, list):
            kinds = {
                _kind(b, depth + 1) for b in branches if not (isinstance(b, dict) and b.get("type") == "null")
            }
            return kinds.pop() if len(kinds) == 1 else "json"
        return "json"
    if kind in _SCALARS:
        return kind
    if kind == "array" and isinstance(node.get("items"), dict):
        item = _kind(node["items"], depth + 1)
        return f"list<{item}>" if item in _SCALARS else "json"
    return "json"


@functools.lru_cache(maxsize=1024)
def answer_kinds(c: Constraint) -> tuple[tuple[str, str], ...]:
    """The answer columns a JSON-schema row's output fills: each top-level property of an
    object schema with its kind (ANSWER_KINDS), in the schema's order. None for other
    constraints, and for schemas whose property names could not be column names (too many,
    too long, unprintable): their answers stay in `parsed`."""
    if c.kind != "json_schema":
        return ()
    try:
        schema = json.loads(c.spec)
    except (ValueError, RecursionError):
        return ()
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not 0 < len(properties) <= MAX_ANSWER_FIELDS:
        return ()
    if not all(0 < len(name) <= MAX_FIELD_NAME and name.isprintable() for name in properties):
        return ()
    return tuple((name, _kind(node)) for name, node in properties.items())


def merge_kinds(union: dict[str, str], kinds: tuple[tuple[str, str], ...]) -> None:
    """The union rule of answer columns over schemas: a field two schemas type differently is
    JSON text; past MAX_ANSWER_COLUMNS a new field gets no column (its answers stay in `parsed`)."""
    for name, kind in kinds:
        if name in union:
            union[name] = kind if union[name] == kind else "json"
        elif len(union) < MAX_ANSWER_COLUMNS:
            union[name] = kind

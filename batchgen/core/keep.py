"""A stage's `keep_if`: which rows go on to the next stage, as a small expression over the row's values.

Parsed with Python's own expression parser and then walked here, never evaluated by Python: only
the forms below exist, so a rule cannot call, index, import or loop, and it is checked whole
(names included) before any work starts.

    score.choice_scores.yes > 0.5 and not caption.generated_text == ""
    tags.status == "ok" and ("cat" in caption.generated_text or width >= 512)

- values: numbers, strings in quotes, true / false / null (or True / False / None);
- names: a job column, or an earlier stage's value by its dotted name (`caption.generated_text`,
  `score.choice_scores.yes`, `tags.answer.tags`); a value a row does not have is null;
- `==`, `!=`, `<`, `<=`, `>`, `>=` (chained as in `0.2 < x <= 0.9`), `in` and `not in` (a text
  inside a text); `and`, `or`, `not`, parentheses, a minus sign before a number.
A comparison that cannot be made (a number against a text, anything against null but `==` and
`!=`) is false rather than an error: the row is not kept. Bounds: 1,000 characters, 200 parts,
nesting 32 deep, numbers up to 1e15, texts of 1,000 characters.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from .errors import ConfigError

__all__ = ["KeepIf", "MAX_CHARS"]

MAX_CHARS, MAX_NODES, MAX_DEPTH = 1000, 200, 32
MAX_NUMBER, MAX_TEXT = 1e15, 1000
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_ORDER: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


@dataclass(frozen=True, slots=True)
class KeepIf:
    """A checked rule: its text, its tree and the names it reads."""

    text: str
    tree: ast.expr
    names: frozenset[str]

    @classmethod
    def parse(cls, text: str, known: Collection[str] | None = None, where: str = "keep_if") -> KeepIf:
        """The rule, or a ConfigError naming what is wrong with it (`known`: the names a row
        can have; another name is refused, with the names it may use)."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: a rule is a non-empty text, e.g. 'score.choice_scores.yes > 0.5'")
        if len(text) > MAX_CHARS:
            raise ConfigError(f"{where}: {len(text)} characters; a rule holds at most {MAX_CHARS}")
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            why = e.msg if isinstance(e, SyntaxError) else "too deeply nested"
            raise ConfigError(f"{where}: {text!r:.80} is not a rule ({why})") from None
        names: set[str] = set()
        _check(tree, names, 0, [0], where)
        if known is not None:
            unknown = sorted(n for n in names if n not in known and n.split(".", 1)[0] not in known)
            if unknown:
                offered = ", ".join(sorted(known)[:20]) or "none"
                raise ConfigError(f"{where}: unknown name(s) {', '.join(unknown)} (known: {offered})")
        return cls(text, tree, frozenset(names))

    def keeps(self, values: Mapping[str, Any]) -> bool:
        """Whether a row with these values (dotted names) goes on."""
        return _truthy(_value(self.tree, values))


def _check(node: ast.AST, names: set[str], depth: int, count: list[int], where: str) -> None:
    """The tree uses only the language's forms, within its bounds."""
    count[0] += 1
    if count[0] > MAX_NODES or depth > MAX_DEPTH:
        raise ConfigError(f"{where}: too large a rule (at most {MAX_NODES} parts, {MAX_DEPTH} deep)")
    if isinstance(node, ast.BoolOp):
        parts = node.values
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        parts = [node.operand]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if not (isinstance(node.operand, ast.Constant) and _number(node.operand.value)):
            raise ConfigError(f"{where}: a minus sign goes before a number only")
        parts = [node.operand]
    elif isinstance(node, ast.Compare):
        allowed = (*_ORDER, ast.Eq, ast.NotEq, ast.In, ast.NotIn)
        if not all(isinstance(op, allowed) for op in node.ops):
            raise ConfigError(f"{where}: compare with ==, !=, <, <=, >, >=, in or not in")
        parts = [node.left, *node.comparators]
    elif isinstance(node, ast.Constant):
        _literal(node.value, where)
        return
    elif isinstance(node, ast.Name | ast.Attribute):
        name = _dotted(node)
        if name is None or any(part.startswith("_") for part in name.split(".")):
            raise ConfigError(f"{where}: a name is words joined by dots, like caption.generated_text")
        if name not in _WORDS:
            names.add(name)
        return
    else:
        what = type(node).__name__
        raise ConfigError(
            f"{where}: {what} is not part of the rule language (names, values, comparisons, and/or/not)"
        )
    for part in parts:
        _check(part, names, depth + 1, count, where)


def _literal(value: object, where: str) -> None:
    if isinstance(value, bool) or value is None:
        return
    if _number(value):
        if abs(value) > MAX_NUMBER:
            raise ConfigError(f"{where}: numbers up to {MAX_NUMBER:g}")
        return
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise ConfigError(f"{where}: texts of at most {MAX_TEXT} characters")
        return
    raise ConfigError(f"{where}: {type(value).__name__} values are not part of the rule language")


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` as one name (never an attribute looked up on a value)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head is not None else None
    return None


def _value(node: ast.expr, values: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_truthy(_value(v, values)) for v in node.values)
        return any(_truthy(_value(v, values)) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        inner = _value(node.operand, values)
        return not _truthy(inner) if isinstance(node.op, ast.Not) else -inner
    if isinstance(node, ast.Compare):
        left = _value(node.left, values)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _value(right_node, values)
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Constant):
        return node.value
    name = _dotted(node)
    assert name is not None  # _check saw to it
    return _WORDS[name] if name in _WORDS else values.get(name)


def _compare(op: ast.cmpop, left: Any, right: Any) -> bool:
    if isinstance(op, ast.Eq | ast.NotEq):
        same = left == right if _comparable(left, right) or left is None or right is None else False
        return same if isinstance(op, ast.Eq) else not same
    if isinstance(op, ast.In | ast.NotIn):
        if not (isinstance(left, str) and isinstance(right, str)):
            return False
        return (left in right) == isinstance(op, ast.In)
    if not _comparable(left, right) or left is None:
        return False
    return _ORDER[type(op)](left, right)


def _comparable(left: Any, right: Any) -> bool:
    return (
        (_number(left) and _number(right))
        or (isinstance(left, str) and isinstance(right, str))
        or (isinstance(left, bool) and isinstance(right, bool))
    )


def _truthy(value: Any) -> bool:
    return value is True or (_number(value) and value != 0) or (isinstance(value, str) and value != "")

"""Each generation parameter's rule, and the bounds of a row (scored answers, tools, a loop's span)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeGuard

__all__ = [
    "Problem",
    "Check",
    "is_int",
    "is_number",
    "rule",
    "stop",
    "answers",
    "loop_span",
    "on_off",
    "logit_bias",
    "tools",
    "tool_choice",
    "MOST_CHOICES",
    "MOST_TOP",
    "MOST_SCORED",
    "MOST_TOOLS",
    "LOOP_SPAN",
    "TOOL_CHOICES",
]

Problem = tuple[str, str]  # (field, message)
Check = Callable[[object], tuple[object, "str | None"]]  # a value → (the value to use, or a problem)


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rule(ok: Callable[[Any], bool], want: str, cast: Callable[[Any], object] = lambda v: v) -> Check:
    return lambda v: (cast(v), None) if ok(v) else (None, f"expected {want}, got {v!r:.60}")


def stop(v: object) -> tuple[object, str | None]:
    if isinstance(v, str):
        v = [v]
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v):
        return tuple(v), None
    return None, f"expected a string or a list of non-empty strings, got {v!r:.60}"


MOST_CHOICES = 16  # completions per row: each is a row's worth of decoding
MOST_TOP = 20  # top_logprobs per token: OpenAI's bound
MOST_SCORED = 64  # answers scored for one row: each is a forward pass over its tokens


def answers(v: object) -> tuple[object, str | None]:
    """Answers to score: none (an empty list: the run's flag not given), or up to 64 strings,
    each once (scores keep the answers' positions: a repeat dropped would shift them)."""
    if isinstance(v, (list, tuple)) and len(v) <= MOST_SCORED and all(isinstance(c, str) and c for c in v):
        twice = next((c for i, c in enumerate(v) if c in v[:i]), None)
        return (None, f"{twice!r:.60} given twice: give each answer once") if twice else (tuple(v), None)
    return None, f"expected up to {MOST_SCORED} non-empty strings, got {v!r:.60}"


LOOP_SPAN = 64  # `stop_repetition: true`: a cycle repeated over this many tokens ends the row


def loop_span(v: object) -> tuple[object, str | None]:
    """true (64 tokens), false (off), or the tokens a repeating cycle must span: 0 or 8 .. 65536."""
    if isinstance(v, bool):
        return (LOOP_SPAN if v else 0), None
    if is_int(v) and (v == 0 or 8 <= v <= 65536):
        return v, None
    return None, f"expected true, false or a number of tokens (0 = off, or 8 to 65536), got {v!r:.60}"


def on_off(v: object) -> tuple[object, str | None]:
    """true / false, or "on" / "off" as the command line gives it."""
    if isinstance(v, bool):
        return v, None
    if isinstance(v, str) and v.lower() in ("on", "off", "true", "false"):
        return v.lower() in ("on", "true"), None
    return None, f"expected on or off (true or false), got {v!r:.60}"


def logit_bias(v: object) -> tuple[object, str | None]:
    """OpenAI's {"token id": bias in [-100, 100]}, as (id, bias) pairs."""
    try:
        pairs = tuple(sorted((int(k), float(b)) for k, b in v.items())) if isinstance(v, dict) else None
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(0 <= k < 2**31 and -100 <= b <= 100 for k, b in pairs):
        return None, f"expected {{token id: bias in [-100, 100]}}, got {v!r:.60}"
    return pairs, None


MOST_TOOLS = 128  # OpenAI's bound on a request's tools
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and dots, as vLLM takes)
TOOL_CHOICES = ("auto", "none", "required")


def tools(v: object) -> tuple[object, str | None]:
    """OpenAI's `tools`: up to 128 `{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`, names unique; kept as given (the chat template renders them)."""
    if not isinstance(v, list) or len(v) > MOST_TOOLS:
        return None, f"expected a list of up to {MOST_TOOLS} tools, got {v!r:.60}"
    names: set[str] = set()
    for i, tool in enumerate(v):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            want = "{type: function, function: {name, parameters}}"
            return None, f"tools[{i}]: expected {want}, got {tool!r:.60}"
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            want = "a function name of letters, digits, _ . - (1 to 64)"
            return None, f"tools[{i}]: expected {want}, got {name!r:.60}"
        if name in names:
            return None, f"tools[{i}]: {name!r} given twice"
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            return None, f"tools[{i}]: parameters must be a JSON schema object"
        if not isinstance(function.get("description", ""), str):
            return None, f"tools[{i}]: description must be a string"
    return tuple(v), None


def tool_choice(v: object) -> tuple[object, str | None]:
    """auto, none, required, or `{"type": "function", "function": {"name"}}` (kept as the name)."""
    if v in TOOL_CHOICES:
        return v, None
    function = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str) and _TOOL_NAME.fullmatch(name) and name not in TOOL_CHOICES:
        return name, None
    return None, f"expected auto, none, required or {{type: function, function: {{name}}}}, got {v!r:.60}"

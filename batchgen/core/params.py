"""Generation parameters, each declared once: its check, its help and the OpenAI body fields
that carry it. Row checks, run defaults, CSV typing, the OpenAI Batch mapping and the CLI
options all derive from `PARAMS`; defaults live in `GenParams`, which checks itself by them
however it is made."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from .errors import ConfigError

__all__ = [
    "Constraint",
    "GenParams",
    "Param",
    "PARAMS",
    "NUMBERS",
    "OPENAI_FIELDS",
    "MOST_SCORED",
    "check_params",
    "tool_problems",
    "is_int",
    "is_number",
    "SEEDED_SAMPLER",
    "seeded",
]


@dataclass(slots=True, frozen=True)
class Constraint:
    """What a row's output must be (constrain.py): `kind` json_schema, json_object, regex or
    choice; `spec` its JSON schema, regex, or JSON list of choices, as text (hashable)."""

    kind: str
    spec: str = ""

    @property
    def json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


@dataclass(slots=True, frozen=True, kw_only=True)
class GenParams:
    """Sampling parameters for one row: run defaults overlaid with the row's own. Made any
    way (a row's parse, the run's flags, `dataclasses.replace`, Python), each value is checked
    by its parameter's rule (a value off its default only: the defaults are good)."""

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    completions: int = 1  # of the one prompt (OpenAI's `n`; a column named `n` is the row's data)
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # the output must match a schema, regex or choice
    seed: int | None = None
    system: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False  # record each generated token's log-probability
    top_logprobs: int = 0  # ... and its k likeliest alternatives (asks for logprobs too)
    choices_to_score: tuple[str, ...] = ()  # answers to score as the assistant's reply
    score_only: bool = False  # score the row's choices / text without generating
    stop_repetition: int = 0  # end a row once its last N tokens repeat a cycle (sampling.Loops); 0: off
    thinking: bool | None = None  # a thinking model reasons first (None: on, as mlx-lm renders it)
    reasoning_budget: int | None = None  # reasoning tokens before the end marker is forced
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools the chat template is given
    tool_choice: str = "auto"  # auto, none, required, or the name of the function to call

    def __post_init__(self) -> None:
        for param in PARAMS:
            value = getattr(self, param.name)
            if value is None or value == param.default:
                continue
            _, problem = param.check(_as_given(param.name, value))
            if problem:
                raise ConfigError(f"generation parameter {param.name}: {problem}")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


def _as_given(name: str, value: object) -> object:
    """A built value as a row would give it to its check: tuples as lists, (id, bias) pairs as
    an object, a tool_choice naming a function as OpenAI's object."""
    if name == "tool_choice" and value not in _TOOL_CHOICES:
        return {"type": "function", "function": {"name": value}}
    if isinstance(value, tuple):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): v for k, v in value}
        return list(value)
    return value


Problem = tuple[str, str]  # (field, message)
Check = Callable[[object], tuple[object, "str | None"]]  # a value → (the value to use, or a problem)


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rule(ok: Callable[[Any], bool], want: str, cast: Callable[[Any], object] = lambda v: v) -> Check:
    return lambda v: (cast(v), None) if ok(v) else (None, f"expected {want}, got {v!r:.60}")


def _stop(v: object) -> tuple[object, str | None]:
    if isinstance(v, str):
        v = [v]
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v):
        return tuple(v), None
    return None, f"expected a string or a list of non-empty strings, got {v!r:.60}"


_MOST_CHOICES = 16  # completions per row: each is a row's worth of decoding
_MOST_TOP = 20  # top_logprobs per token: OpenAI's bound
MOST_SCORED = 64  # answers scored for one row: each is a forward pass over its tokens


def _answers(v: object) -> tuple[object, str | None]:
    """Answers to score: none (an empty list: the run's flag not given), or up to 64 strings,
    each once (scores keep the answers' positions: a repeat dropped would shift them)."""
    if isinstance(v, (list, tuple)) and len(v) <= MOST_SCORED and all(isinstance(c, str) and c for c in v):
        twice = next((c for i, c in enumerate(v) if c in v[:i]), None)
        return (None, f"{twice!r:.60} given twice: give each answer once") if twice else (tuple(v), None)
    return None, f"expected up to {MOST_SCORED} non-empty strings, got {v!r:.60}"


LOOP_SPAN = 64  # `stop_repetition: true`: a cycle repeated over this many tokens ends the row

# How a seeded sampled row draws (generate/sampling.Seeded): each token keyed by the row's seed
# and its position. Part of the fingerprints of seeded rows and runs, so results drawn another
# way (before version 2: the global random state, one row at a time) are never mixed with these.
SEEDED_SAMPLER = 2


def seeded(value: object) -> bool:
    """Whether a job row's raw value gives a seed (a column, or an OpenAI Batch body's)."""
    if not isinstance(value, dict):
        return False
    body = value.get("body")
    return value.get("seed") is not None or isinstance(body, dict) and body.get("seed") is not None


def _loop_span(v: object) -> tuple[object, str | None]:
    """true (64 tokens), false (off), or the tokens a repeating cycle must span: 0 or 8 .. 65536."""
    if isinstance(v, bool):
        return (LOOP_SPAN if v else 0), None
    if is_int(v) and (v == 0 or 8 <= v <= 65536):
        return v, None
    return None, f"expected true, false or a number of tokens (0 = off, or 8 to 65536), got {v!r:.60}"


def _on_off(v: object) -> tuple[object, str | None]:
    """true / false, or "on" / "off" as the command line gives it."""
    if isinstance(v, bool):
        return v, None
    if isinstance(v, str) and v.lower() in ("on", "off", "true", "false"):
        return v.lower() in ("on", "true"), None
    return None, f"expected on or off (true or false), got {v!r:.60}"


def _logit_bias(v: object) -> tuple[object, str | None]:
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
_TOOL_CHOICES = ("auto", "none", "required")


def _tools(v: object) -> tuple[object, str | None]:
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


def _tool_choice(v: object) -> tuple[object, str | None]:
    """auto, none, required, or `{"type": "function", "function": {"name"}}` (kept as the name)."""
    if v in _TOOL_CHOICES:
        return v, None
    function = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str) and _TOOL_NAME.fullmatch(name) and name not in _TOOL_CHOICES:
        return name, None
    return None, f"expected auto, none, required or {{type: function, function: {{name}}}}, got {v!r:.60}"


def tool_problems(p: GenParams) -> list[Problem]:
    """What a row's tool_choice asks that its tools cannot give."""
    names = [t["function"]["name"] for t in p.tools]
    if p.tool_choice in ("auto", "none"):
        return []
    if not names:
        return [("tool_choice", f"{p.tool_choice!r} needs tools")]
    if p.tool_choice != "required" and p.tool_choice not in names:
        listed = ", ".join(names)[:200]
        return [("tool_choice", f"names {p.tool_choice!r}, which is not one of the tools ({listed})")]
    return []


@dataclass(frozen=True, slots=True)
class Param:
    """One generation parameter: `check` turns a value as a row (JSON) gives it into the
    value or a problem; `cli` is the command-line option's type (None: no option)."""

    name: str
    check: Check
    help: str
    cli: type | None = None
    openai: tuple[str, ...] = ()  # OpenAI Batch body fields that carry it

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]


# A reasoning budget's bound: the longest thinking Qwen3's card suggests (32,768 tokens). A
# larger one would lift every length limit but the context's (a typo of 10**9 reasons until
# the context ends), so it is a row's error instead.
MAX_REASONING = 32768

PARAMS = (
    Param(
        "max_tokens",
        _rule(lambda v: is_int(v) and v >= 1, "a positive integer"),
        "Most new tokens per row (capped at what the model's context leaves)",
        int,
        ("max_tokens", "max_completion_tokens"),
    ),
    Param(
        "temperature",
        _rule(lambda v: is_number(v) and v >= 0, "a number >= 0", float),
        "Sampling temperature; 0 is greedy",
        float,
        ("temperature",),
    ),
    Param(
        "top_p",
        _rule(lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]", float),
        "Nucleus sampling",
        float,
        ("top_p",),
    ),
    Param(
        "top_k",
        _rule(lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
        "Top-k sampling; 0 is off",
        int,
        ("top_k",),
    ),
    Param(
        "min_p",
        _rule(lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]", float),
        "Min-p sampling",
        float,
        ("min_p",),
    ),
    Param(
        "repetition_penalty",
        _rule(lambda v: is_number(v) and v > 0, "a number > 0", float),
        "Repetition penalty; 1 is off",
        float,
        ("repetition_penalty",),
    ),
    Param(
        "presence_penalty",
        _rule(is_number, "a number", float),
        "Presence penalty",
        float,
        ("presence_penalty",),
    ),
    Param(
        "frequency_penalty",
        _rule(is_number, "a number", float),
        "Frequency penalty",
        float,
        ("frequency_penalty",),
    ),
    Param("logit_bias", _logit_bias, 'Bias by token id, e.g. {"42": -100}', None, ("logit_bias",)),
    Param(
        "completions",
        _rule(lambda v: is_int(v) and 1 <= v <= _MOST_CHOICES, f"an integer in [1, {_MOST_CHOICES}]"),
        "Completions per row (OpenAI's n)",
        int,
        ("n",),
    ),
    Param("stop", _stop, "Stop sequence (repeatable)", str, ("stop",)),
    Param(
        "seed",
        _rule(lambda v: is_int(v) and 0 <= v < 2**64, "an integer in [0, 2**64)"),  # MLX's range
        "Sampling seed",
        int,
        ("seed",),
    ),
    Param("system", _rule(lambda v: isinstance(v, str), "a string"), "System prompt", str),
    Param(
        "chat_template_kwargs",
        _rule(lambda v: isinstance(v, dict), "an object", dict),
        "Chat template keywords",
        None,
        ("chat_template_kwargs",),
    ),
    Param(
        "logprobs",
        _rule(lambda v: isinstance(v, bool), "true or false"),
        "Record each generated token's log-probability (a logprobs column)",
        bool,
        ("logprobs",),
    ),
    Param(
        "top_logprobs",
        _rule(lambda v: is_int(v) and 0 <= v <= _MOST_TOP, f"an integer in [0, {_MOST_TOP}]"),  # noqa: E501
        "... and its k likeliest alternatives",
        int,
        ("top_logprobs",),
    ),
    Param("choices_to_score", _answers, "An answer to score (repeatable): choice_scores", str),
    Param(
        "score_only",
        _rule(lambda v: isinstance(v, bool), "true or false"),
        "Score the row's choices or text without generating",
        bool,
    ),
    Param(
        "stop_repetition",
        _loop_span,
        "End a row whose last N tokens repeat a cycle of up to 32 tokens (finish_reason repetition, "
        "its text up to the first repeat); 0 is off",
        int,
    ),
    Param(
        "thinking",
        _on_off,
        "on / off: a thinking model reasons before answering (its template's enable_thinking, or "
        "an empty closed block); unset, on for a thinking model, as mlx-lm renders it",
        str,
    ),
    Param(
        "reasoning_budget",
        _rule(
            lambda v: is_int(v) and 0 <= v <= MAX_REASONING,
            f"an integer from 0 to {MAX_REASONING:,} (the most allowed)",
        ),
        "A thinking model's most reasoning tokens: then its end marker is written and the answer "
        "gets max_tokens",
        int,
        ("reasoning_budget", "thinking_token_budget"),
    ),
    Param("tools", _tools, "OpenAI function tools, given to the chat template", None, ("tools",)),
    Param(
        "tool_choice",
        _tool_choice,
        "auto, none, required or a function: its call constrained",
        None,
        ("tool_choice",),
    ),
)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_DEFAULTS = {f.name: _default(f) for f in dataclasses.fields(GenParams)}
NUMBERS = tuple(p.name for p in PARAMS if p.cli in (int, float))  # typed as numbers in CSV cells
OPENAI_FIELDS = {field: p.name for p in PARAMS for field in p.openai}  # body field → parameter


def check_params(values: dict[str, object], base: GenParams) -> tuple[list[Problem], GenParams]:
    """Overlay the generation parameters present in `values` on `base`; None means absent."""
    problems: list[Problem] = []
    given: dict[str, Any] = {}  # each value of its field's type: its param's check made it so
    for param in PARAMS:
        if values.get(param.name) is None:
            continue
        value, problem = param.check(values[param.name])
        if problem:
            problems.append((param.name, problem))
        else:
            given[param.name] = value
    return problems, dataclasses.replace(base, **given)

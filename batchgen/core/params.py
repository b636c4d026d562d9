"""Generation parameters, each declared once: its check, its help and the OpenAI body fields that carry it.

Row checks, run defaults, CSV typing, the OpenAI Batch mapping and the CLI options all derive
from `PARAMS`; defaults live in `GenParams`, which checks itself by them however it is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import rules
from .errors import ConfigError
from .rules import TOOL_CHOICES, Check, Problem, is_int, is_number

__all__ = [
    "Constraint",
    "GenParams",
    "Param",
    "PARAMS",
    "NUMBERS",
    "OPENAI_FIELDS",
    "check_params",
    "tool_problems",
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
    if name == "tool_choice" and value not in TOOL_CHOICES:
        return {"type": "function", "function": {"name": value}}
    if isinstance(value, tuple):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): v for k, v in value}
        return list(value)
    return value


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
        rules.rule(lambda v: is_int(v) and v >= 1, "a positive integer"),
        "Most new tokens per row (capped at what the model's context leaves)",
        int,
        ("max_tokens", "max_completion_tokens"),
    ),
    Param(
        "temperature",
        rules.rule(lambda v: is_number(v) and v >= 0, "a number >= 0", float),
        "Sampling temperature; 0 is greedy",
        float,
        ("temperature",),
    ),
    Param(
        "top_p",
        rules.rule(lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]", float),
        "Nucleus sampling",
        float,
        ("top_p",),
    ),
    Param(
        "top_k",
        rules.rule(lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
        "Top-k sampling; 0 is off",
        int,
        ("top_k",),
    ),
    Param(
        "min_p",
        rules.rule(lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]", float),
        "Min-p sampling",
        float,
        ("min_p",),
    ),
    Param(
        "repetition_penalty",
        rules.rule(lambda v: is_number(v) and v > 0, "a number > 0", float),
        "Repetition penalty; 1 is off",
        float,
        ("repetition_penalty",),
    ),
    Param(
        "presence_penalty",
        rules.rule(is_number, "a number", float),
        "Presence penalty",
        float,
        ("presence_penalty",),
    ),
    Param(
        "frequency_penalty",
        rules.rule(is_number, "a number", float),
        "Frequency penalty",
        float,
        ("frequency_penalty",),
    ),
    Param("logit_bias", rules.logit_bias, 'Bias by token id, e.g. {"42": -100}', None, ("logit_bias",)),
    Param(
        "completions",
        rules.rule(
            lambda v: is_int(v) and 1 <= v <= rules.MOST_CHOICES, f"an integer in [1, {rules.MOST_CHOICES}]"
        ),
        "Completions per row (OpenAI's n)",
        int,
        ("n",),
    ),
    Param("stop", rules.stop, "Stop sequence (repeatable)", str, ("stop",)),
    Param(
        "seed",
        rules.rule(lambda v: is_int(v) and 0 <= v < 2**64, "an integer in [0, 2**64)"),  # MLX's range
        "Sampling seed",
        int,
        ("seed",),
    ),
    Param("system", rules.rule(lambda v: isinstance(v, str), "a string"), "System prompt", str),
    Param(
        "chat_template_kwargs",
        rules.rule(lambda v: isinstance(v, dict), "an object", dict),
        "Chat template keywords",
        None,
        ("chat_template_kwargs",),
    ),
    Param(
        "logprobs",
        rules.rule(lambda v: isinstance(v, bool), "true or false"),
        "Record each generated token's log-probability (a logprobs column)",
        bool,
        ("logprobs",),
    ),
    Param(
        "top_logprobs",
        rules.rule(lambda v: is_int(v) and 0 <= v <= rules.MOST_TOP, f"an integer in [0, {rules.MOST_TOP}]"),  # noqa: E501
        "... and its k likeliest alternatives",
        int,
        ("top_logprobs",),
    ),
    Param("choices_to_score", rules.answers, "An answer to score (repeatable): choice_scores", str),
    Param(
        "score_only",
        rules.rule(lambda v: isinstance(v, bool), "true or false"),
        "Score the row's choices or text without generating",
        bool,
    ),
    Param(
        "stop_repetition",
        rules.loop_span,
        "End a row whose last N tokens repeat a cycle of up to 32 tokens (finish_reason repetition, "
        "its text up to the first repeat); 0 is off",
        int,
    ),
    Param(
        "thinking",
        rules.on_off,
        "on / off: a thinking model reasons before answering (its template's enable_thinking, or "
        "an empty closed block); unset, on for a thinking model, as mlx-lm renders it",
        str,
    ),
    Param(
        "reasoning_budget",
        rules.rule(
            lambda v: is_int(v) and 0 <= v <= MAX_REASONING,
            f"an integer from 0 to {MAX_REASONING:,} (the most allowed)",
        ),
        "A thinking model's most reasoning tokens: then its end marker is written and the answer "
        "gets max_tokens",
        int,
        ("reasoning_budget", "thinking_token_budget"),
    ),
    Param("tools", rules.tools, "OpenAI function tools, given to the chat template", None, ("tools",)),
    Param(
        "tool_choice",
        rules.tool_choice,
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

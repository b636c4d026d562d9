"""Tool calls: a row's answer read with mlx-lm's parser into OpenAI's `tool_calls`.

The format is mlx-lm's (its loader infers one from the chat template or the vocabulary:
`<tool_call>` JSON for Qwen and Hermes, Gemma 4's `<|tool_call>`, Mistral's `[TOOL_CALLS]`,
...), the split of the text into what was said and the calls its server's, and each call
parsed by that format's `parse_tool_call`. A call that does not parse (cut short by
max_tokens, or a model that cannot write one) is dropped, as the server drops it, the good
calls beside it kept; its text stays in the answer as written, never a call that was not
made.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper, _infer_tool_parser

from ...core.constraints import TOOL_CALL_FORMAT
from ...core.errors import RowError
from ...core.params import GenParams
from ...core.records import Generation, ToolCall
from ..base.arrays import Tokenizer
from .reasoning import segments

__all__ = ["ToolFormat", "find_format", "check_tools", "with_tool_calls"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model's tool-call format: mlx-lm's parser module's name, markers and parse function."""

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


def find_format(tokenizer: Tokenizer) -> ToolFormat | None:
    """The tokenizer's tool-call format, or None (chat.traits asks once a model): the one
    mlx-lm's loader chose (a TokenizerWrapper keeps its parser), else inferred as that loader
    infers it (a Hugging Face tokenizer, as mlx-vlm's processors hold)."""
    hf: Tokenizer = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    if not hasattr(hf, "chat_template"):  # not a Hugging Face tokenizer: no template, no format
        return None
    name = hf.init_kwargs.get("tool_parser_type") if hasattr(hf, "init_kwargs") else None
    name = name or _infer_tool_parser(hf)
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def _offered(p: GenParams) -> bool:
    return bool(p.tools) and p.tool_choice != "none"


def check_tools(p: GenParams, fmt: ToolFormat | None) -> None:
    """A row's tools refused up front where the model (its tool-call format `fmt`) cannot take
    them: no format (its calls could not be read), or a tool_choice constraint on a format
    that is not JSON."""
    if not _offered(p):
        return
    if fmt is None:
        raise RowError("generate", "the row has tools, but the model has no tool-call format mlx-lm knows")
    if p.constraint is not None and p.constraint.kind == "tool_call" and fmt.name != TOOL_CALL_FORMAT[0]:
        raise RowError(
            "generate",
            f"tool_choice {p.tool_choice!r} is constrained in the JSON tool-call format only; "
            f"the model's is {fmt.name!r} (give tool_choice auto)",
        )


def with_tool_calls(gen: Generation, p: GenParams, fmt: ToolFormat | None) -> Generation:
    """The answer's calls (in the model's format `fmt`) in `tool_calls` and what was said
    besides them in its text; a row that stopped after its calls ends with `tool_calls`."""
    if not _offered(p) or fmt is None or fmt.start not in gen.text:
        return gen
    ends = [(fmt.end, "normal")] if fmt.end else []  # a format whose calls run to the end has none
    runs = segments(TextStateMachine({"normal": [(fmt.start, "tool")], "tool": ends}), "normal", gen.text)
    parsed: list[ToolCall] = []
    said: list[str] = []
    for k, (part, text) in enumerate(runs):
        if part != "tool":
            said.append(text)
            continue
        calls = _parsed(fmt, text, p)
        if calls is None:  # not a call: its text stays in the answer as written, markers and all
            closed = k < len(runs) - 1 and fmt.end
            said.append(fmt.start + text + (fmt.end if closed else ""))
            continue
        parsed += [_openai(call, gen, len(parsed) + j) for j, call in enumerate(calls)]
    if not parsed:
        return gen
    gen.tool_calls = parsed
    gen.text = "".join(said).strip()
    if gen.finish_reason == "stop":
        gen.finish_reason = "tool_calls"
    return gen


def _parsed(fmt: ToolFormat, text: str, p: GenParams) -> list[dict[str, Any]] | None:
    """One call's text read by the format's parser (a list where it writes several), or None:
    a call the model did not finish or could not write. mlx-lm's server also drops such a call
    and keeps the others."""
    try:
        found = fmt.parse(text, [t["function"] for t in p.tools])
    except Exception:  # noqa: BLE001 - whatever the parser raises on text it cannot read
        return None
    calls = found if isinstance(found, list) else [found]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return calls


def _openai(call: dict[str, Any], gen: Generation, k: int) -> ToolCall:
    """OpenAI's shape of one call, its arguments JSON-encoded as mlx-lm's server encodes them
    (an `arguments` the parser gives as a string is encoded as a string); its id derived from
    the answer, so a rerun writes the same."""
    text = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    digest = hashlib.sha256(f"{k}:{gen.text}".encode()).hexdigest()[:24]
    return {"id": f"call_{digest}", "type": "function", "function": {"name": call["name"], "arguments": text}}

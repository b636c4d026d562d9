"""Thinking models: reasoning markers, a row's reasoning bounded and split from its answer.

The markers are mlx-lm's (`TokenizerWrapper` infers them: `<think>` … `</think>`, Gemma 4's
`<|channel>thought` … `<channel|>`, …). Where a row stands when decoding starts comes from its
prompt, as mlx-lm's server decides it: a template that opened a block leaves the row reasoning;
a row whose thinking is on may open one with its first tokens; otherwise it answers at once.
The split of the text is mlx-lm's server's (`TextStateMachine`, on decoded text); the token
counts and the parts of logprobs come from the same transitions on token ids.

While a row decodes, `Thinking` is one logits processor that owns both rules that depend on
the part: a reasoning budget (after N reasoning tokens the end marker is forced) and the
row's output constraint, whose grammar starts after the end marker (mlx-vlm's
ThinkingAwareLogitsProcessor's rule), so a schema row may think first and still answers valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import mlx.core as mx
from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ...core.params import GenParams
from ...core.records import Generation
from ..base.arrays import Tokenizer, scalar

__all__ = [
    "Markers",
    "Thinking",
    "Part",
    "find_markers",
    "initial_part",
    "budgeted",
    "split_generation",
    "segments",
    "thinking_of",
]

Part = Literal["reasoning", "answer", "open"]  # open: thinking is on and no block opened yet

# An empty closed block as templates write one (Qwen3's with enable_thinking false; Gemma 4's):
# the block a row's thinking off appends where its template cannot, and what an answer is
# scored after.
_EMPTY_BLOCK = {"<|channel>thought": ("<|channel>thought\n", "<channel|>")}


@dataclass(frozen=True, slots=True)
class Markers:
    """A tokenizer's reasoning markers, as text and as token ids; its tool-call markers, where
    it has a tool-call format (a call ends the reasoning, as in mlx-lm's server); and mlx-lm's
    server's text state machine for the tokenizer."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    machine: TextStateMachine = field(compare=False)
    tool: tuple[str, str | None] | None = None  # a call's start and end markers
    tool_ids: tuple[int, ...] = ()  # ... its start as token ids

    def opened(self, ids: list[int]) -> bool:
        """The prompt ends inside a reasoning block (its last start after its last end)."""
        return _rfind(ids, self.start_ids) > _rfind(ids, self.end_ids)

    def closed_at_end(self, ids: list[int]) -> bool:
        """The prompt ends with a closed block (a template's thinking off): the row answers."""
        end = _rfind(ids, self.end_ids)
        return end >= 0 and end >= len(ids) - len(self.end_ids) - 2 and end > _rfind(ids, self.start_ids)

    def block(self, opened: bool) -> str:
        """The text that closes reasoning at once: an empty block, or the end of an open one."""
        start, end = _EMPTY_BLOCK.get(self.start, (f"{self.start}\n\n", f"{self.end}\n\n"))
        return end if opened else start + end

    def parts(self, tokens: list[int], opened: bool) -> list[str]:
        """Each generated token's part: "reasoning" inside a block, "marker" for the markers,
        else "answer" (a tool call's start in a block ends it); the transitions of `split`, on
        token ids."""
        out, state, i = [], "reasoning" if opened else "answer", 0
        while i < len(tokens):
            if state == "reasoning" and self.tool_ids and _at(tokens, i, self.tool_ids):
                state = "answer"  # the call and what follows it are the answer's
                continue
            marker = self.end_ids if state == "reasoning" else self.start_ids
            if _at(tokens, i, marker):
                out += ["marker"] * len(marker)
                i += len(marker)
                state = "answer" if state == "reasoning" else "reasoning"
                continue
            out.append(state)
            i += 1
        return out

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of a completion's text, split as mlx-lm's server splits it: the
        reasoning as the server keeps it, whitespace and all; None when the row never reasoned.
        The answer is what the server says besides, its tool calls kept in it as written (with
        their markers) for `with_tool_calls` to read, and without the whitespace that separates
        it from a block (the template's, not the answer's: exports, scores and `parsed` read it)."""
        merged = segments(self.machine, "reasoning" if opened else "normal", text)
        seen = opened or any(part == "reasoning" for part, _ in merged)
        reasoning = "".join(chunk for part, chunk in merged if part == "reasoning")
        answer = []
        for k, (part, chunk) in enumerate(merged):
            if part == "normal":
                answer.append(chunk)
            elif part == "tool" and self.tool is not None:
                start, end = self.tool
                closed = k < len(merged) - 1  # something followed: its end marker was written
                answer.append(start + chunk + ((end or "") if closed else ""))
        said = "".join(answer)
        return (reasoning if seen else None), (said.lstrip() if seen else said)


def segments(machine: TextStateMachine, initial: str, text: str) -> list[tuple[str, str]]:
    """A text's runs by the state `machine` is in over them (mlx-lm's server's split), the
    markers between them out, a run of one state one segment: a segment followed by another
    was closed by its end marker."""
    state, found = TextStateMachine.split(machine.make_state(initial), text)
    _, rest, last = TextStateMachine.flush(state)
    merged: list[tuple[str, str]] = []
    for part, chunk in [*found, (last, rest)]:
        if merged and merged[-1][0] == part:
            merged[-1] = (part, merged[-1][1] + chunk)
        else:
            merged.append((part, chunk))
    return merged


def _at(ids: list[int], i: int, marker: tuple[int, ...]) -> bool:
    return tuple(ids[i : i + len(marker)]) == marker


def _ends(ids: list[int], marker: tuple[int, ...]) -> bool:
    return len(ids) >= len(marker) and _at(ids, len(ids) - len(marker), marker)


def _rfind(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `ids`, or -1 (a scan from the end, no copy of the prompt)."""
    n, first = len(marker), marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == marker:
            return i
    return -1


def find_markers(tokenizer: Tokenizer) -> Markers | None:
    """The tokenizer's markers, or None for a model that does not think (chat.traits asks once
    a model). mlx-lm's wrapper knows them; a Hugging Face tokenizer (what mlx-vlm's processors
    hold) is asked through one."""
    wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    start, end = wrapper.think_start_tokens, wrapper.think_end_tokens
    if not (wrapper.has_thinking and start and end):
        return None
    tool = (wrapper.tool_call_start, wrapper.tool_call_end) if wrapper.has_tool_calling else None
    tool_ids = tuple(wrapper.encode(tool[0], add_special_tokens=False)) if tool else ()
    machine = make_text_state_machine(wrapper)
    return Markers(wrapper.think_start, wrapper.think_end, tuple(start), tuple(end), machine, tool, tool_ids)


def initial_part(markers: Markers | None, p: GenParams, ids: list[int]) -> Part:
    """Where a row stands when it starts decoding: unless its thinking is off, a thinking
    model may open a block (mlx-lm's rule: thinking is on unless a row turns it off)."""
    if markers is None:
        return "answer"
    if markers.opened(ids):
        return "reasoning"
    if markers.closed_at_end(ids) or p.thinking is False:
        return "answer"
    return "open"


def _room(budget: int, markers: Markers, part: Part) -> int:
    """The tokens a budget adds to a row: the reasoning, its end marker, its start if the row opens it."""
    return budget + len(markers.end_ids) + (len(markers.start_ids) if part == "open" else 0)


def budgeted(p: GenParams, markers: Markers | None, part: Part) -> GenParams:
    """A row with a reasoning budget that may reason: room for the budget and its markers
    besides max_tokens, which is then the answer's (its Thinking ends the answer there)."""
    if markers is None or p.reasoning_budget is None or part == "answer":
        return p
    return dataclasses.replace(p, max_tokens=p.max_tokens + _room(p.reasoning_budget, markers, part))


class Mask(Protocol):
    """A row's constraint as Thinking applies it (constrain.Masking): to answer tokens only."""

    def consume(self, token: int, /) -> None: ...

    def masked(self, logits: mx.array, also: tuple[int, ...] = (), /) -> mx.array: ...


class Thinking:
    """One row's reasoning while it decodes, as a logits processor (it sees each step's history,
    whose last token is the one sampled at the step before): the part the row is in, the
    reasoning tokens spent, the marker tokens it must write next, and the row's constraint
    mask, applied to answer tokens only. In the "open" part the mask also lets the start
    marker's first token through; once that is written, the rest of the marker follows.

    With a budget, `max_tokens` (the row's own, before `budgeted`) is the answer's: it counts
    from the token after the end marker, however early the row closed its block."""

    def __init__(
        self,
        markers: Markers,
        part: Part,
        budget: int | None,
        mask: Mask | None = None,
        max_tokens: int | None = None,
    ):
        self.markers, self.part, self.budget, self.mask = markers, part, budget, mask
        self.answer_max = (
            max_tokens - _room(budget, markers, part) if budget is not None and max_tokens else None
        )
        self.answer_start: int | None = None  # the index of the answer's first generated token
        self.forced: list[int] = []  # marker tokens the next steps must write
        self.closing = False  # ... the end marker: the answer starts after them
        self.spent = 0  # reasoning tokens so far, the markers not counted
        self.tail: list[int] = []  # the last tokens, to see the end marker written
        self.calls = 0
        self._check_budget()

    def _feed(self, token: int) -> None:
        m, at = self.markers, self.calls - 1  # `token` is the generated token at index `at`
        if self.forced:  # the mask let nothing else through
            self.forced.pop(0)
            if not self.forced and self.closing:
                self.part, self.closing, self.answer_start = "answer", False, at + 1
        elif self.part == "open" and token == m.start_ids[0]:
            self.part, self.forced = "reasoning", list(m.start_ids[1:])
        elif self.part != "reasoning":
            if self.part == "open":
                self.part, self.answer_start = "answer", at
            if self.mask is not None:
                self.mask.consume(token)
        else:
            self.tail = [*self.tail, token][-max(len(m.end_ids), len(m.tool_ids)) :]
            if _ends(self.tail, m.end_ids):
                self.part, self.answer_start = "answer", at + 1
            elif self.mask is None and m.tool_ids and _ends(self.tail, m.tool_ids):
                self.part, self.answer_start = "answer", at + 1 - len(m.tool_ids)  # a call ends reasoning
            else:
                self.spent += 1
        self._check_budget()

    def answer_full(self, generated: int, last: int) -> bool:
        """Whether the answer has its max_tokens, `generated` tokens in (the last, `last`, not
        yet seen here: a row still "open" answers with it unless it opens a block)."""
        if self.answer_max is None:
            return False
        start = self.answer_start
        if start is None and self.part == "open" and not self.forced and last != self.markers.start_ids[0]:
            start = generated - 1
        return start is not None and generated - start >= self.answer_max

    def _check_budget(self) -> None:
        if (
            self.part == "reasoning"
            and not self.forced
            and self.budget is not None
            and self.spent >= self.budget
        ):
            self.forced, self.closing = list(self.markers.end_ids), True

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.calls:
            self._feed(scalar(history[-1]))
        self.calls += 1
        if self.forced:
            only = mx.arange(logits.shape[-1]) == self.forced[0]
            return mx.where(only, logits, -mx.inf)
        if self.mask is None or self.part == "reasoning":
            return logits
        also = (self.markers.start_ids[0],) if self.part == "open" else ()
        return self.mask.masked(logits, also)


def thinking_of(processors: Iterable[object]) -> Thinking | None:
    """A row's Thinking among its logits processors (None: it has none)."""
    return next((p for p in processors if isinstance(p, Thinking)), None)


def split_generation(gen: Generation, tokens: list[int], markers: Markers | None, opened: bool) -> Generation:
    """A generation's text as its answer, its reasoning apart (with its token count), and each
    logprob record marked with its part."""
    if markers is None:
        return gen
    gen.reasoning, gen.text = markers.split(gen.text, opened)
    parts = markers.parts(tokens, opened)
    gen.reasoning_tokens = sum(p == "reasoning" for p in parts) if gen.reasoning is not None else 0
    for record, part in zip(gen.logprobs or [], parts, strict=False):
        record["part"] = "reasoning" if part == "marker" else part
    return gen

"""Thinking models: a tokenizer's reasoning markers, a row's reasoning bounded while it decodes
and split from its answer afterwards, the same on every lane.

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
import threading
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..core.records import Generation, GenParams
from .arrays import Tokenizer, scalar
from .constrain import Masking

__all__ = ["Markers", "Thinking", "Part", "markers_of", "initial_part", "budgeted", "split_generation"]

Part = Literal["reasoning", "answer", "open"]  # open: thinking is on and no block opened yet

# An empty closed block as templates write one (Qwen3's with enable_thinking false; Gemma 4's):
# the block a row's thinking off appends where its template cannot, and what an answer is
# scored after.
_EMPTY_BLOCK = {"<|channel>thought": ("<|channel>thought\n", "<channel|>")}


@dataclass(frozen=True, slots=True)
class Markers:
    """A tokenizer's reasoning markers, as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

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
        else "answer"; the transitions of `split`, on token ids."""
        out, state, i = [], "reasoning" if opened else "answer", 0
        while i < len(tokens):
            marker = self.end_ids if state == "reasoning" else self.start_ids
            if tuple(tokens[i : i + len(marker)]) == marker:
                out += ["marker"] * len(marker)
                i += len(marker)
                state = "answer" if state == "reasoning" else "reasoning"
                continue
            out.append(state)
            i += 1
        return out

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of a completion's text, split as mlx-lm's server splits it, each
        without the whitespace around it; reasoning None when the row never reasoned."""
        machine = TextStateMachine(
            {"normal": [(self.start, "reasoning")], "reasoning": [(self.end, "normal")]}
        )
        state, segments = TextStateMachine.split(
            machine.make_state("reasoning" if opened else "normal"), text
        )
        _, rest, last = TextStateMachine.flush(state)
        segments.append((last, rest))
        seen = opened or any(s == "reasoning" for s, _ in segments)
        reasoning = "".join(t for s, t in segments if s == "reasoning").strip()
        answer = "".join(t for s, t in segments if s == "normal")
        return (reasoning if seen else None), (answer.lstrip() if seen else answer)


def _rfind(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `ids`, or -1 (a scan from the end, no copy of the prompt)."""
    n, first = len(marker), marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == marker:
            return i
    return -1


_KNOWN: dict[int, tuple[Tokenizer, Markers | None]] = {}
_LOCK = threading.Lock()


def markers_of(tokenizer: Tokenizer) -> Markers | None:
    """The tokenizer's markers, or None for a model that does not think. mlx-lm's wrapper knows
    them; a Hugging Face tokenizer (what mlx-vlm's processors hold) is asked through one."""
    key = id(tokenizer)
    with _LOCK:
        if key not in _KNOWN:
            wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
            found = None
            start, end = wrapper.think_start_tokens, wrapper.think_end_tokens
            if wrapper.has_thinking and start and end:
                found = Markers(wrapper.think_start, wrapper.think_end, tuple(start), tuple(end))
            _KNOWN[key] = (tokenizer, found)  # the tokenizer kept: its id is never reused meanwhile
        return _KNOWN[key][1]


def thinking_on(p: GenParams, template: str | None) -> bool:
    """Whether a row asks to think: its `thinking`, else the engines' rule (mlx-vlm renders
    templates with enable_thinking false where they take it; a template without one thinks
    as it will)."""
    if p.thinking is not None:
        return p.thinking
    return "enable_thinking" not in (template or "")


def initial_part(markers: Markers | None, p: GenParams, ids: list[int], template: str | None) -> Part:
    """Where a row stands when it starts decoding."""
    if markers is None:
        return "answer"
    if markers.opened(ids):
        return "reasoning"
    if markers.closed_at_end(ids) or not thinking_on(p, template):
        return "answer"
    return "open"


def budgeted(p: GenParams, markers: Markers | None, part: Part) -> GenParams:
    """A row with a reasoning budget that may reason: room for the budget and the end marker
    besides max_tokens, which is then the answer's (at least)."""
    if markers is None or p.reasoning_budget is None or part == "answer":
        return p
    extra = p.reasoning_budget + len(markers.end_ids) + (len(markers.start_ids) if part == "open" else 0)
    return dataclasses.replace(p, max_tokens=p.max_tokens + extra)


class Thinking:
    """One row's reasoning while it decodes, as a logits processor (it sees each step's history,
    whose last token is the one sampled at the step before): the part the row is in, the
    reasoning tokens spent, the marker tokens it must write next, and the row's constraint
    mask, applied to answer tokens only. In the "open" part the mask also lets the start
    marker's first token through; once that is written, the rest of the marker follows."""

    def __init__(self, markers: Markers, part: Part, budget: int | None, mask: Masking | None = None):
        self.markers, self.part, self.budget, self.mask = markers, part, budget, mask
        self.forced: list[int] = []  # marker tokens the next steps must write
        self.closing = False  # ... the end marker: the answer starts after them
        self.spent = 0  # reasoning tokens so far, the markers not counted
        self.tail: list[int] = []  # the last tokens, to see the end marker written
        self.calls = 0
        self._check_budget()

    def _feed(self, token: int) -> None:
        m = self.markers
        if self.forced:  # the mask let nothing else through
            self.forced.pop(0)
            if not self.forced and self.closing:
                self.part, self.closing = "answer", False
        elif self.part == "open" and token == m.start_ids[0]:
            self.part, self.forced = "reasoning", list(m.start_ids[1:])
        elif self.part != "reasoning":
            self.part = "answer"
            if self.mask is not None:
                self.mask.consume(token)
        else:
            self.tail = [*self.tail, token][-len(m.end_ids) :]
            if tuple(self.tail) == m.end_ids:
                self.part = "answer"
            else:
                self.spent += 1
        self._check_budget()

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

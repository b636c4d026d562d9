"""A loaded model's traits, read once as it loads and handed to whatever needs them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import llguidance as llg
import llguidance.hf

from ...core.params import GenParams
from ...core.records import Generation
from ..base.arrays import Tokenizer
from .reasoning import Markers, Part, budgeted, find_markers, initial_part, split_generation
from .tool_calls import ToolFormat, check_tools, find_format, with_tool_calls

__all__ = ["Traits"]


@dataclass(eq=False)
class Traits:
    """A model's tokenizer and what batchgen reads off it once, as the model loads: its
    thinking markers and its tool-call format; and llguidance's view of its vocabulary, made on
    the first constrained row (a walk over the vocabulary). One record per model, held beside it
    (`load.loading.Models`) and handed to every lane and step that needs it: nothing is looked
    up again per row, and nothing is kept anywhere by the tokenizer's identity."""

    tokenizer: Tokenizer
    markers: Markers | None  # None: the model does not think
    tool_format: ToolFormat | None  # None: no tool-call format mlx-lm knows
    _guides: dict[tuple[int, ...], llg.LLTokenizer] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, owner: object) -> Traits:
        """The traits of a tokenizer, or of the processor holding one (mlx-vlm's)."""
        tokenizer: Tokenizer = getattr(owner, "tokenizer", owner)
        return cls(tokenizer, find_markers(tokenizer), find_format(tokenizer))

    def opening(self, params: GenParams, ids: list[int]) -> tuple[Part, GenParams]:
        """A row's first steps on this model, the same in every lane: its tools refused where
        the model cannot take them; where a thinking model's row starts in its prompt `ids`
        (reasoning, free to open a block, or answering; a model that does not think needs none)
        and its params with room for a reasoning budget."""
        check_tools(params, self.tool_format)
        part = initial_part(self.markers, params, ids)
        return part, budgeted(params, self.markers, part)

    def closing(self, gen: Generation, tokens: list[int], part: Part, params: GenParams) -> Generation:
        """A row's last steps, the same in every lane: the reasoning split from the answer
        (`part`: where the row started), the answer's tool calls read."""
        gen = split_generation(gen, tokens, self.markers, part == "reasoning")
        return with_tool_calls(gen, params, self.tool_format)

    def guide(self, eos: list[int]) -> llg.LLTokenizer:
        """llguidance's view of the vocabulary with these end tokens, made once for each set."""
        key = tuple(sorted(eos))
        with self._lock:
            if key not in self._guides:
                # mlx-lm wraps the Hugging Face tokenizer (mlx-vlm's processors hold it as it is).
                t = self.tokenizer
                hf = t._tokenizer if type(t).__name__ == "TokenizerWrapper" else t
                self._guides[key] = llguidance.hf.from_tokenizer(hf, eos_token=list(key))
            return self._guides[key]

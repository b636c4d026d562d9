"""Answers scored without generating them: choices or a given text, teacher-forced.

The prompt is prefilled once (from the longest cached prefix: the image a row shares with
others), its last logits score every answer's first token, and the answers' other tokens
go through one forward pass on copies of the prompt's cache, right-padded to one length
(padding after a token never changes what came before it). Log-probabilities are the
model's own distribution, in float32: no penalty, bias, mask or temperature applies.
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx

from ...core.records import ChoiceScore, Scoring
from ..base.arrays import Tokenizer, floats
from ..base.watch import Watch
from ..chat.traits import Traits
from ..decode.adapters import Adapter, Sequence
from ..decode.batch_cache import KVQuant, merge_caches
from ..decode.prefill import prefill
from ..decode.prefix_cache import PrefixCache
from ..decode.sampling import log_softmax

__all__ = ["Scores", "score", "score_row", "answer_ids", "END_OF_TURN"]

# End-of-turn tokens of the chat templates batchgen runs: an answer is scored up to and with it.
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<turn|>", "</s>")

_LOGITS_FLOATS = 2**25  # logits held at once while scoring (128 MB of float32): answers go in groups


def answer_ids(tokenizer: Tokenizer, text: str, eos: set[int]) -> list[int]:
    """An answer's tokens as the assistant says it: its text, then the end-of-turn token."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    end = next((vocab[t] for t in END_OF_TURN if vocab.get(t) in eos), min(eos))
    return [*tokenizer.encode(text, add_special_tokens=False), end]


class Scores:
    """A row's scores: per choice (total logprob, tokens) and the text's, normalized choices."""

    def __init__(self, scoring: Scoring, totals: list[float], lengths: list[int]):
        n = len(scoring.choices)
        self.choices: list[ChoiceScore] = [
            {"choice": c, "logprob": lp, "tokens": k}
            for c, lp, k in zip(scoring.choices, totals[:n], lengths[:n], strict=True)
        ]
        if self.choices:
            top = max(c["logprob"] for c in self.choices)
            norm = top + math.log(sum(math.exp(c["logprob"] - top) for c in self.choices))
            for c in self.choices:
                c["prob"] = math.exp(c["logprob"] - norm)
        self.text = (totals[n], lengths[n]) if scoring.text is not None else None

    @property
    def best(self) -> str | None:
        return max(self.choices, key=lambda c: c["logprob"])["choice"] if self.choices else None


def score(
    adapter: Adapter,
    seq: Sequence,
    answers: list[list[int]],
    prefixes: PrefixCache | None,
    watch: Watch,
    lead: list[int] | None = None,
    kv: KVQuant | None = None,
) -> list[float]:
    """Each answer's total log-probability after the row's prompt and `lead` (tokens every
    answer follows without being scored: a thinking model's closed block). With `kv`, on the
    row's quantized cache: a quantized cache quantizes a pass's own keys before they are
    attended to, so an answer fed at once reads what it would read generated token by token."""
    lead = lead or []
    answers = [[*lead, *ans] for ans in answers]
    cache, a = prefill(adapter, seq, prefixes, watch, kv)
    last = adapter.forward(seq, cache, a, len(seq.ids))  # the prompt's last logits
    first = log_softmax(last)[0]
    totals = [0.0] * len(answers)
    rest = [(j, ans) for j, ans in enumerate(answers) if len(ans) > 1]
    width = max([len(ans) - 1 for _, ans in rest], default=0)
    group = max(1, _LOGITS_FLOATS // max(1, width * last.shape[-1]))
    for g in range(0, len(rest), group):
        watch.check_stop()
        part = rest[g : g + group]
        n = max(len(ans) - 1 for _, ans in part)
        feed = mx.array([ans[:-1] + [0] * (n + 1 - len(ans)) for _, ans in part])
        target = mx.array([ans[1:] + [0] * (n + 1 - len(ans)) for _, ans in part])
        mask = mx.array(
            [
                [float(k >= len(lead)) for k in range(1, len(ans))] + [0.0] * (n + 1 - len(ans))
                for _, ans in part
            ]
        )
        lp = log_softmax(adapter.continue_all(seq, merge_caches([copy.deepcopy(cache) for _ in part]), feed))
        picked = mx.take_along_axis(lp, target[..., None], axis=-1)[..., 0]
        for (j, _), total in zip(part, floats((picked * mask).sum(axis=-1)), strict=True):
            totals[j] = total
    heads = floats(first[mx.array([ans[0] for ans in answers])]) if not lead else [0.0] * len(answers)
    return [head + tail for head, tail in zip(heads, totals, strict=True)]


def score_row(
    adapter: Adapter,
    seq: Sequence,
    scoring: Scoring,
    traits: Traits,
    eos: set[int],
    prefixes: PrefixCache | None,
    watch: Watch,
    context: int | None,
    kv: KVQuant | None = None,
) -> Scores:
    """A row's choices and text scored; an answer past the model's context is the row's error.
    A thinking model's row that would reason first scores its answers after its prompt with
    thinking off (`seq.scored_after`: exactly what the template writes then, its cached prefix
    shared), or, on a lane that gives none, after an empty closed block."""
    texts = [*scoring.choices, *([scoring.text] if scoring.text is not None else [])]
    tokenizer, markers = traits.tokenizer, traits.markers
    answers = [answer_ids(tokenizer, t, eos) for t in texts]
    lead = []
    if seq.scored_after is not None:
        pairs = zip(seq.ids, seq.scored_after, strict=False)
        shared = next(
            (k for k, (a, b) in enumerate(pairs) if a != b), min(len(seq.ids), len(seq.scored_after))
        )
        seq.ids, seq.boundaries = seq.scored_after, [b for b in seq.boundaries if b[0] <= shared]
    elif markers is not None and seq.part != "answer":
        lead = tokenizer.encode(markers.block(seq.part == "reasoning"), add_special_tokens=False)
    longest = max(len(a) for a in answers) + len(lead)
    if context and len(seq.ids) + longest > context:
        raise ValueError(
            f"prompt and answer ({len(seq.ids)} + {longest} tokens) exceed the context of {context}"
        )
    totals = score(adapter, seq, answers, prefixes, watch, lead, kv)
    return Scores(scoring, totals, [len(a) for a in answers])

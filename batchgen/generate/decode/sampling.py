"""A row's sampling rules on every lane: sampler, logits processors, stop strings, final text."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import mlx.core as mx

from ...core.params import GenParams
from ...core.records import TokenLogprobs
from ..base.arrays import float_rows, floats, int_rows
from ..chat.constrain import processor
from ..chat.reasoning import Part, Thinking
from ..chat.traits import Traits

__all__ = [
    "HISTORY",
    "sampler_for",
    "Seeded",
    "draws_of",
    "Positioned",
    "rounds_sampler",
    "logits_processors_for",
    "hit_stop",
    "Loops",
    "MAX_PERIOD",
    "final_text",
    "token_logprobs",
    "log_softmax",
    "engine_logprobs",
    "greedy",
    "logprob_records",
]

# Logits processors (penalties) see the prompt and then the generated tokens, on every lane
# (mlx-lm's rule; one_row.py brings mlx-vlm's generate to it): its last HISTORY tokens, more
# than any penalty's own window.
HISTORY = 256


def sampler_for(p: GenParams) -> Callable[[mx.array], mx.array] | None:
    """None for greedy rows; a seeded row's own Seeded sampler; else mlx-lm's sampler, which
    draws from the global random state."""
    if p.temperature == 0:
        return None
    if p.seed is not None:
        return Seeded(p)
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(p.temperature, p.top_p if p.top_p < 1 else 0.0, p.min_p, top_k=p.top_k)


class Seeded:
    """A seeded row's sampler: mlx-lm's filters in make_sampler's order (top-p, min-p, top-k),
    then a draw whose key comes from the row's seed and the token's position alone, never the
    global random state. Its tokens depend on its seed and its logits only: the same at any
    batch width, beside any batch mates, in any row order, batched or one at a time. It is
    called once per generated token (position 0 first), as the decoder and the engines'
    one-row loops call a sampler; the decoder draws for every row of one recipe at once."""

    def __init__(self, p: GenParams):
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        self.seed, self.scale, self.position = p.seed or 0, 1.0 / p.temperature, 0
        top_p = p.top_p if 0 < p.top_p < 1 else None
        self.recipe = (p.temperature, top_p, p.min_p, p.top_k)  # rows of one recipe draw together
        self.filters: list[Callable[[mx.array], mx.array]] = []
        if top_p is not None:
            self.filters.append(lambda x: apply_top_p(x, top_p))
        if p.min_p:
            self.filters.append(lambda x: apply_min_p(x, p.min_p))
        if p.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, p.top_k))

    def __call__(self, logprobs: mx.array) -> mx.array:
        """Tokens for `logprobs`' rows, one position each: one row in a plain loop; in
        mlx-lm's speculative loop, a draft block's positions in turn. Shaped as the logits'
        leading axes, as mlx-lm's samplers return them (an MTP head reads (rows, 1))."""
        rows = logprobs.reshape(-1, logprobs.shape[-1])
        return Seeded.draw([self] * rows.shape[0], rows).reshape(logprobs.shape[:-1])

    @staticmethod
    def draw(samplers: list[Seeded], logprobs: mx.array) -> mx.array:
        """A token for each row of `logprobs` (rows of one recipe), each drawn with its own
        sampler's key for its next position: one evaluation for all of them."""
        keys = []
        for s in samplers:
            keys.append(_position_key(s.seed, s.position))
            s.position += 1
        return samplers[0]._keyed(logprobs, keys)

    def at(self, logprobs: mx.array, positions: list[int]) -> mx.array:
        """Tokens for `logprobs`' rows at the given positions, keyed as `draw` keys them, the
        sampler's own position untouched."""
        return self._keyed(logprobs, [_position_key(self.seed, p) for p in positions])

    def _keyed(self, logprobs: mx.array, keys: list[int]) -> mx.array:
        for keep in self.filters:
            logprobs = keep(logprobs)
        scaled = logprobs * self.scale
        stacked = mx.stack([mx.random.key(k) for k in keys])
        return mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(scaled, stacked)


def draws_of(p: GenParams) -> tuple | None:
    """What decides a row's draws besides its logits: None for a greedy row, else its recipe
    and its seed (None: the global random state). Rows with equal values can share one sampler."""
    if p.temperature == 0:
        return None
    return (p.temperature, p.top_p if 0 < p.top_p < 1 else None, p.min_p, p.top_k, p.seed)


class Positioned:
    """The sampler of a wave in mlx-vlm's batched speculative rounds, whose rows share one
    `draws_of` and a seed. The rounds draw the target's tokens through `sample_target`, naming
    each row's generated-token position but not the row (every row id is 0), and draft
    greedily; each token keyed as `Seeded` keys it, so a row's tokens are those its seed gives
    without the drafter (a proposal is kept only where it equals that draw)."""

    def __init__(self, p: GenParams):
        self.seeded = Seeded(p)

    def __call__(self, logprobs: mx.array) -> mx.array:
        raise RuntimeError("mlx-vlm drew a seeded row's token without its position")

    def sample_target(self, logprobs: mx.array, *, row_ids: list[int], positions: list[int]) -> mx.array:
        return self.seeded.at(logprobs, positions)


def rounds_sampler(p: GenParams) -> Callable[[mx.array], mx.array] | None:
    """The sampler for a wave of mlx-vlm's batched speculative rounds (rows of one `draws_of`):
    None for greedy rows, a Positioned one for seeded rows, else mlx-lm's, which draws from the
    global random state as the engine's rounds keep it."""
    if p.temperature != 0 and p.seed is not None:
        return Positioned(p)
    return sampler_for(p)


def _position_key(seed: int, position: int) -> int:
    """A 64-bit key seed for one draw: the row's seed and the token's position, mixed."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8, person=b"batchgen-draw").digest()
    return int.from_bytes(digest, "little")


def logits_processors_for(
    p: GenParams,
    traits: Traits | None = None,
    eos: set[int] | None = None,
    part: Part = "answer",
) -> list[Callable]:
    """The row's penalties and biases (mlx-lm's), then its output constraint's mask, which
    needs the model's traits (its vocabulary as llguidance sees it) and the end tokens it
    allows once the output is complete; a row that may reason (`part`, on a model whose traits
    have markers) gets them through its Thinking, which keeps the mask for the answer and
    forces the end marker at the row's reasoning budget."""
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(
        logit_bias=dict(p.logit_bias) or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )
    mask = None
    if p.constraint is not None:
        if traits is None:
            raise ValueError("a constrained row needs its model's traits")
        mask = processor(p.constraint, traits.guide(sorted(eos or ())))
    markers = traits.markers if traits is not None else None
    if markers is not None and part != "answer" and (mask is not None or p.reasoning_budget is not None):
        processors.append(Thinking(markers, part, p.reasoning_budget, mask, p.max_tokens))
    elif mask is not None:
        processors.append(mask)
    return processors


def engine_logprobs(logits: mx.array) -> mx.array:
    """What the engines' samplers draw from: the logits less their logsumexp, in the logits' own
    dtype, as mlx-lm's and mlx-vlm's generate loops compute it (log_softmax, for the logprobs
    a row reports, works in float32 instead)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(logits: mx.array) -> mx.array:
    """The engines' greedy token: the argmax of engine_logprobs, not of the logits. On a bf16
    model the subtraction rounds near-equal logits to one value, and argmax then takes the lower
    id, as both engines do; the raw logits' argmax would part from them there."""
    return mx.argmax(engine_logprobs(logits), axis=-1)


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis, in float32 (a model's bf16 logits lose digits)."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def token_logprobs(
    shaped: mx.array, picked: list[int], ks: list[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each row's chosen token's log-probability and its k likeliest tokens (id, logprob),
    likeliest first, from the logits a row's token was picked from: after its penalties,
    biases and constraint mask, before temperature (mlx-lm's and OpenAI's rule: the model's
    distribution over what the row may say, whatever sampler then draws from it). Computed in
    float32; one evaluation for all rows."""
    lp = log_softmax(shaped)
    chosen = mx.take_along_axis(lp, mx.array(picked)[:, None], axis=-1)[:, 0]
    k = max(ks)
    if k:
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(lp, top, axis=-1)
        mx.eval(chosen, top, values)
        rows = zip(int_rows(top), float_rows(values), ks, strict=True)
        # a token a constraint masked has logprob -inf: no alternative (and no number JSON can hold)
        tops = [
            sorted(((u, x) for u, x in zip(t, v, strict=True) if x > -math.inf), key=lambda x: -x[1])[:n]
            for t, v, n in rows
        ]
    else:
        mx.eval(chosen)
        tops = [[] for _ in picked]
    return list(zip(floats(chosen), tops, strict=True))


def logprob_records(
    tokens: list[int],
    logprobs: list[tuple[float, list[tuple[int, float]]]],
    decode: Callable[[list[int]], str],
) -> list[TokenLogprobs]:
    """The `logprobs` column of a row: per generated token its text, id, logprob and top alternatives."""
    return [
        {
            "token": decode([t]),
            "id": t,
            "logprob": lp,
            "top_logprobs": [{"token": decode([u]), "id": u, "logprob": v} for u, v in top],
        }
        for t, (lp, top) in zip(tokens, logprobs, strict=True)
    ]


MAX_PERIOD = 32  # the longest cycle the loop stop looks for, in tokens


class Loops:
    """Whether a row's tokens have fallen into a loop: its last `span` tokens repeat a cycle of
    at most MAX_PERIOD tokens ("a red, red, red, ..."). Kept up to date a token at a time:
    for each period p, how many tokens in a row have equalled the one p before — a fixed
    MAX_PERIOD comparisons a token, however long the row."""

    __slots__ = ("span", "runs")

    def __init__(self, span: int):
        self.span = span
        self.runs = [0] * MAX_PERIOD

    def cut(self, tokens: list[int]) -> int | None:
        """After the newest token: None, or how many tokens to keep (up to the end of the
        cycle's first occurrence) when the loop spans `span` tokens."""
        n, last = len(tokens), tokens[-1]
        found = None
        for p in range(1, MAX_PERIOD + 1):
            run = self.runs[p - 1] + 1 if n > p and tokens[-1 - p] == last else 0
            self.runs[p - 1] = run
            if found is None and run >= p and run + p >= self.span:
                found = n - run  # the loop started p tokens before its first repeat
        return found


def hit_stop(tokens: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> bool:
    """Stop strings are looked for in a bounded tail of the text, not the whole of it."""
    longest = max(len(s) for s in stop)
    tail = decode(tokens[-(longest + 8) :])
    return any(s in tail for s in stop)


def final_text(
    tokens: list[int], eos: set[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]
) -> str:
    """The completion as text: without its end-of-turn token, cut before the first stop string."""
    text = decode(tokens[:-1] if tokens and tokens[-1] in eos else tokens)
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(hits)] if hits else text

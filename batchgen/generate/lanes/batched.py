"""Generation lanes: the ways a row can be generated, each behind one small interface.

A lane turns a row into a `Plan` (tokenized, grouped with the rows it shares work with) and
runs a batch of its plans, each row getting its Generation or its RowError:
- `TextLane`: mlx-lm models, batched, with prefix reuse (or on quantized caches, --kv-bits);
  `SpeculativeLane` (speculative.py): rows with a text draft model, speculating batched;
- `VisionLane`, `OffsetVisionLane` (vision_lanes.py): media rows of the Qwen-VL families
  (mRoPE positions) and of the families positioned by their cache offsets, batched;
- `SingleLane`: mlx-vlm's own generate, one row at a time (audio, images beside a video,
  other families, vision drafters, media rows on quantized KV caches);
- `LMSingleLane`: mlx-lm's own generate, one row at a time: its speculative loop with a text
  draft model, or its quantized KV cache for a row that crosses --quantized-kv-start while
  it decodes.
`Router.route` (router.py) chooses the lane of each row.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...core.errors import RowError, short
from ...core.records import Generation, Job, Media
from ..base.models import ModelInfo
from ..base.watch import Watch
from ..chat.prompts import check_length, message_bounds, render, template_kwargs, text_only
from ..chat.traits import Traits
from ..decode.adapters import Adapter, LMAdapter, Sequence
from ..decode.batch_cache import KVQuant
from ..decode.decoder import decode_stream
from ..decode.memory import Footprint, Memory, out_of_memory
from ..decode.prefix_cache import PrefixCache
from ..decode.sampling import logprob_records
from ..load.loading import Models
from .scoring import Scores, score_row

__all__ = [
    "Plan",
    "Lane",
    "BatchedLane",
    "TextLane",
    "completions",
    "row_error",
    "seq_of",
]


@dataclass(slots=True)
class Plan:
    """A row ready for its lane: the decoder sequence, and the batch grouping key."""

    job: Job
    media: Media
    lane: Lane
    seq: Sequence | None = None
    group: tuple = ()  # rows with equal groups share prefixes: run them together
    adapter: str | None = None  # the adapter folder the row runs with (Router.plan)

    @property
    def solo(self) -> bool:
        """The row's lane runs one row at a time (a seeded row batches: its draws are its own)."""
        return self.lane.solo

    @property
    def span(self) -> int:
        """The most tokens the row's cache may hold: its prompt (where tokenized) and max_tokens."""
        if self.seq is None:
            return self.job.params.max_tokens
        return len(self.seq.ids) + self.seq.params.max_tokens


class Lane:
    """How a row is generated. `solo` lanes run one row at a time. `kv`: the rows' caches
    quantized (--kv-bits) as the engines' generate quantizes them (such rows keep no prefix
    snapshots)."""

    name = "lane"
    solo = False

    def __init__(
        self,
        models: Models,
        info: ModelInfo,
        prefixes: PrefixCache | None = None,
        memory: Memory | None = None,
        kv: KVQuant | None = None,
    ):
        self.models, self.info, self.memory, self.kv = models, info, memory, kv
        self.prefixes = None if kv else prefixes
        self._measured: tuple[Footprint | None] | None = None  # the footprint, once measured

    def plan(self, job: Job, media: Media) -> Plan:
        raise NotImplementedError

    def prompt_tokens(self, plan: Plan) -> int:
        """What the row's `prompt_tokens` will be."""
        return len(plan.seq.ids) if plan.seq is not None else 0

    def run(self, plans: list[Plan], watch: Watch, width: int) -> Iterator[tuple[int, Generation | RowError]]:
        """(index in plans, outcome) of each row as it finishes, at most `width` rows at once."""
        raise NotImplementedError

    def _keys(self, ids: list[int], bounds: list[int], media: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Content keys of each prefix: the lane and model, the prefix's token ids, and the digest
        of every image that starts inside it (image tokens alone are the same for all images)."""
        keys = []
        for pos in bounds:
            h = hashlib.sha256(f"{self.name}:{self.info.name}".encode())
            h.update(",".join(map(str, ids[:pos])).encode())
            for start, digest in media:
                if start < pos:
                    h.update(digest.encode())
            keys.append((pos, h.hexdigest()))
        return keys

    def _fit(self, seq: Sequence, traits: Traits) -> Sequence:
        """A row's tools refused where the model cannot take them; where a thinking model's row
        starts (reasoning, free to open a block, or answering) and its room for a reasoning
        budget; then max_tokens lowered to what the model's context leaves after the prompt
        (the row then ends with `length`): a row asking for a billion tokens stops where the
        model must."""
        seq.part, seq.params = traits.opening(seq.params, seq.ids)
        context = self.info.context
        if context and seq.params.max_tokens > context - len(seq.ids):
            seq.params = dataclasses.replace(seq.params, max_tokens=max(context - len(seq.ids), 1))
            seq.capped = True
        if self.memory is not None:  # a row no batch could hold: its error before any work
            self.memory.check_alone(self.footprint(), len(seq.ids), seq.params.max_tokens)
        return seq

    def footprint(self) -> Footprint | None:
        """A row's memory on this lane's model (batched lanes measure it; None: unbounded)."""
        return None


class BatchedLane(Lane):
    """Lanes whose rows decode together through decoder.decode_stream. An out-of-memory while
    a batch runs sends its unfinished rows back in halves (the budget lowered for the rest of
    the run); a row that fails alone is that row's error. `kv`: the rows' caches quantized
    (--kv-bits) as mlx-lm's generate quantizes them."""

    def _decoding(self) -> tuple[Adapter, set[int], Callable[[list[int]], str], Traits]:
        """(adapter, end tokens, detokenizer, the model's traits)."""
        raise NotImplementedError

    def footprint(self) -> Footprint | None:
        """Measured on the first row: later rows' checks build no adapter (and the vision lanes'
        `_decoding` resets the stopping criteria)."""
        if self.memory is None:
            return None
        if self._measured is None:
            adapter = self._decoding()[0]
            model = getattr(adapter, "lm", adapter.model)
            kv = self.kv
            make = adapter.make_cache if kv is None else lambda: kv.quantized(adapter.make_cache())
            self._measured = (self.memory.footprint(model, make, kv),)
        return self._measured[0]

    def run(self, plans: list[Plan], watch: Watch, width: int) -> Iterator[tuple[int, Generation | RowError]]:
        adapter, eos, decode, traits = self._decoding()
        scores: dict[int, Scores | None] = {}
        for i, plan in enumerate(plans):  # scored first: a row's prompt prefix is then cached
            scoring = plan.job.scoring
            if scoring is None:
                continue
            seq = seq_of(_fresh(plan))
            try:
                found = score_row(
                    adapter, seq, scoring, traits, eos, self.prefixes, watch, self.info.context, self.kv
                )
            except Exception as e:  # noqa: BLE001 - a row's error (a stop request is no Exception)
                scores[i] = None
                yield i, row_error(e)
                continue
            scores[i] = found
            if plan.job.params.score_only:
                gen = Generation(
                    text=found.best or "",
                    finish_reason="score",
                    prompt_tokens=len(seq.ids),
                    completion_tokens=0,
                    cached_tokens=seq.cached_tokens,
                )
                yield i, _scored(gen, found)
        todo = [
            i
            for i in range(len(plans))
            if i not in scores or (scores[i] and not plans[i].job.params.score_only)
        ]
        if not todo:
            return
        seqs = [seq_of(plans[i]) for i in todo]
        finished: set[int] = set()
        memory = (self.memory, self.footprint()) if self.memory is not None else None
        try:
            for j in self._stream(adapter, seqs, eos, decode, watch, width, traits, memory):
                finished.add(j)
                yield todo[j], _scored(_generation(seqs[j], decode, traits), scores.get(todo[j]))
        except Exception as e:  # an engine error fails these rows, not the run
            rest = [todo[j] for j in range(len(todo)) if j not in finished]
            if out_of_memory(e):
                yield from self._halves(plans, rest, watch, width, e)
            elif len(todo) == 1:
                yield todo[0], row_error(e)
            else:
                for i in rest:  # find the culprit
                    for _, outcome in self.run([_fresh(plans[i])], watch, 1):
                        yield i, outcome

    def _stream(
        self,
        adapter: Adapter,
        seqs: list[Sequence],
        eos: set[int],
        decode: Callable[[list[int]], str],
        watch: Watch,
        width: int,
        traits: Traits,
        memory: tuple[Memory, Footprint | None] | None,
    ) -> Iterator[int]:
        """The rows decoded together; each row's index as it finishes."""
        return decode_stream(adapter, seqs, eos, decode, self.prefixes, watch, width, traits, memory, self.kv)

    def _halves(
        self, plans: list[Plan], rest: list[int], watch: Watch, width: int, e: Exception
    ) -> Iterator[tuple[int, Generation | RowError]]:
        """After an out-of-memory: the unfinished rows again, in two halves, the budget lowered."""
        if self.memory is not None:
            self.memory.lower()
        if len(rest) == 1:
            what = f"out of memory with the row alone ({short(e, 200)})"
            yield rest[0], RowError("generate", f"{what}; lower max_tokens or its media, or --memory-budget")
            return
        if self.memory is not None:
            self.memory.stats.retried += len(rest)
        half = (len(rest) + 1) // 2
        for part in (rest[:half], rest[half:]):
            for k, outcome in self.run([_fresh(plans[i]) for i in part], watch, width):
                yield part[k], outcome


class TextLane(BatchedLane):
    name = "lm"

    def plan(self, job: Job, media: Media) -> Plan:
        model, tokenizer = self.models.text()
        traits = self.models.traits(vision=False)
        p = job.params
        messages = text_only(job.messages)
        if getattr(tokenizer, "chat_template", None):
            prompt = render(tokenizer, messages, p, traits.markers)
        else:  # base models: the turns' text, one per line
            prompt = "\n".join(m["content"] for m in messages)
        check_length(prompt, None, self.info)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        check_length(prompt, ids, self.info)
        bounds = message_bounds(tokenizer, messages, template_kwargs(tokenizer, p, traits.markers), ids)
        seq = self._fit(Sequence(ids=ids, params=p, boundaries=self._keys(ids, bounds, [])), traits)
        if job.scoring is not None and seq.part != "answer":  # scored as the template writes thinking off
            off = render(tokenizer, messages, dataclasses.replace(p, thinking=False), traits.markers)
            seq.scored_after = tokenizer.encode(off, add_special_tokens=False)
        return Plan(job, media, self, seq, group=(tuple(ids[: bounds[-1]]) if bounds else (),))

    def _decoding(self):
        model, tokenizer = self.models.text()
        return (
            LMAdapter(model),
            set(tokenizer.eos_token_ids),
            tokenizer.decode,
            self.models.traits(vision=False),
        )


def _generation(s: Sequence, decode: Callable[[list[int]], str], traits: Traits) -> Generation:
    """A decoded row as its Generation: reasoning split from the answer, tool calls read."""
    logprobs = logprob_records(s.tokens, s.logprobs, decode) if s.params.wants_logprobs else None
    gen = Generation(
        text=s.text,
        finish_reason=s.finish_reason,
        prompt_tokens=len(s.ids),
        completion_tokens=len(s.tokens),
        cached_tokens=s.cached_tokens,
        capped=s.capped,
        logprobs=logprobs,
        mtp_drafts=s.drafted,
        mtp_accepted=s.accepted,
    )
    return traits.closing(gen, s.tokens, s.part, s.params)


def completions(plan: Plan) -> list[Plan]:
    """A row asking for n completions (OpenAI's `n`) as n plans of its one prompt, decoded
    side by side; seeded sampling takes seed, seed + 1, … so the n draws differ."""
    p = plan.job.params
    out = [plan]
    for k in range(1, p.completions):
        job = plan.job
        if p.seed is not None:
            job = dataclasses.replace(job, params=dataclasses.replace(p, seed=(p.seed + k) % 2**64))
        copy = (
            _fresh(plan) if plan.seq is not None else Plan(job, plan.media, plan.lane, adapter=plan.adapter)
        )
        copy.job = job
        if copy.seq is not None:
            copy.seq.params = dataclasses.replace(copy.seq.params, seed=job.params.seed)
        out.append(copy)
    return out


def _scored(gen: Generation, scores: Scores | None) -> Generation:
    """A generation with the row's scores (choice_scores; the text's total, mean, tokens)."""
    if scores is not None:
        gen.choice_scores = scores.choices or None
        if scores.text is not None:
            total, n = scores.text
            gen.score_logprob, gen.score_mean, gen.score_tokens = total, total / n, n
    return gen


def _fresh(plan: Plan) -> Plan:
    """The same plan with cleared outputs, to run again on its own."""
    s = seq_of(plan)
    seq = Sequence(
        s.ids,
        s.params,
        s.boundaries,
        s.embed,
        s.positions,
        s.delta,
        capped=s.capped,
        part=s.part,
        scored_after=s.scored_after,
    )
    return Plan(plan.job, plan.media, plan.lane, seq, plan.group, plan.adapter)


def seq_of(plan: Plan) -> Sequence:
    """The tokenized row of a plan on a lane that tokenizes (every lane but mlx-vlm's own)."""
    if plan.seq is None:
        raise ValueError(f"row {plan.job.id!r}: planned without its tokens")
    return plan.seq


def row_error(e: Exception) -> RowError:
    """An engine's exception as the row's error: transient, a rerun tries the row again."""
    return RowError("generate", f"{type(e).__name__}: {short(e, 300) or type(e).__name__}", transient=True)

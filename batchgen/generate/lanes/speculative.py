"""Speculative decoding on the batched lanes: a drafter proposes, the target checks, rows keep theirs.

Text draft models (`SpeculativeLane`) speculate in batchgen's own rounds:

A round mirrors mlx-lm's speculative loop for each row (`speculative_generate_step`): the
drafter proposes min(k, tokens left) tokens from the row's last one, the target reads the last
one and all k proposals in one forward pass, the row takes the proposals the target's greedy
choice agrees with and then the target's own next token. Rows accept different counts, so each
row's caches (the target's and the drafter's) drop their own rejected tail (`drop_tails`), and
the next round starts every row from its newest token. The drafter is also fed its last
proposal each round, so a row that accepted all of them goes on from there as mlx-lm's does.
Greedy rows get the target's greedy tokens, the same as without a drafter; a sampling row's
sampler draws its proposals and the target's tokens as in mlx-lm's loop (a seeded row: the
same tokens as mlx-lm's speculative generate with the same keyed sampler).

MTP heads (`VisionSpeculativeLane`) speculate in mlx-vlm's own batched rounds (its
BatchGenerator with the drafter: the target's hidden states and shared keys feed the head, each
row's acceptance walked, the caches rolled back), a wave of rows at a time (mlx-vlm's
speculative batch takes no row while it runs); batchgen reads back each row's tokens, applies
its stop rules and counts each row's drafts from the engine's round records (`EngineRounds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from ..base.arrays import Model, Processor, int_rows
from ..base.watch import Watch
from ..chat.traits import Traits
from ..decode.adapters import Adapter, LMAdapter, Sequence
from ..decode.batch_cache import drop_tails, merge_caches, trim_layer
from ..decode.decoder import DecodeBatch
from ..decode.memory import Footprint, Memory, wired
from ..decode.prefill import prefill_but_last
from ..decode.sampling import draws_of, engine_logprobs, final_text, greedy, rounds_sampler
from ..load.drafts import Drafter
from .batched import TextLane
from .vision import VisionLane

__all__ = ["SpeculativeLane", "SpeculativeBatch", "VisionSpeculativeLane"]


class SpeculativeBatch(DecodeBatch):
    """A batch of rows speculating together: the decoder's rows, stop rules and slots, two
    batch caches (the target's in `merged`, the drafter's in `drafts`). Rows leave as they
    finish and waiting rows join between rounds (continuous batching)."""

    def __init__(
        self,
        adapter: Adapter,
        drafter: Adapter,
        k: int,
        seqs: list[Sequence],
        eos: set[int],
        decode: Callable[[list[int]], str],
        watch: Watch | None,
        width: int | None,
        traits: Traits,
    ):
        super().__init__(adapter, seqs, eos, decode, None, watch, width, traits)
        self.drafter, self.k = drafter, k
        self.drafts: list | None = None  # the drafter's batch cache

    def run(self) -> Iterator[int]:
        """Every row, `drafter` proposing `k` tokens a round, at most `width` rows at a time;
        each row's index as it finishes, with its tokens, text, finish_reason and its drafted
        and accepted counts filled in."""
        with wired():
            while self.active or self.waiting:
                self.join()
                yield from self.step()

    def join(self) -> None:  # type: ignore[override]
        """Waiting rows into the free places, filled but for their last prompt token in both
        models' caches and appended to the batch (a round starts every row from its newest
        token, so a row joins between any two rounds)."""
        rows: list[int] = []
        targets, drafts = [], []
        while self.waiting and len(self.active) + len(rows) < self.width:
            i = self.waiting.pop()
            self.deadlines[i] = self.watch.deadline(time.monotonic())
            targets.append(prefill_but_last(self.adapter, self.seqs[i], self.watch))
            drafts.append(prefill_but_last(self.drafter, self.seqs[i], self.watch))
            rows.append(i)
        if not rows:
            return
        joined = merge_caches(targets), merge_caches(drafts)
        if self.merged is None or self.drafts is None:
            self.merged, self.drafts = joined
        else:
            for cache, more in zip((self.merged, self.drafts), joined, strict=True):
                for layer, extra in zip(cache, more, strict=True):
                    layer.extend(extra)
        self.slots += rows

    def step(self) -> Iterator[int]:
        """One round for every row; yields the rows that finished."""
        self.watch.check_stop()
        rows = self.active
        seqs = [self.seqs[i] for i in rows]
        offered = [min(self.k, s.params.max_tokens - len(s.tokens)) for s in seqs]
        last = mx.array([(s.tokens or s.ids)[-1] for s in seqs])
        token, proposals = last, []
        for step in range(self.k):
            logits = self.drafter.decode(token, self.drafts, seqs)  # type: ignore[arg-type]
            token = self._chosen(rows, logits[:, None], [int(step < n) for n in offered])[:, 0]
            proposals.append(token)
        self.drafter.decode(token, self.drafts, seqs)  # type: ignore[arg-type]  # its keys and values only
        drafted = mx.stack(proposals, axis=1)
        fed = mx.concatenate([last[:, None], drafted], axis=1)
        logits = self.adapter.continue_all(seqs[0], self.merged, fed)  # type: ignore[arg-type]
        chosen = self._chosen(rows, logits, [n + 1 for n in offered])
        mx.eval(chosen, drafted)
        running: list[int] = []
        rejected: list[int] = []
        for i, said, proposed, n_offered in zip(
            rows, int_rows(chosen), int_rows(drafted), offered, strict=True
        ):
            n = self._round(i, said, proposed, n_offered)
            if n is not None:
                running.append(i)
                rejected.append(self.k - n)
        yield from (i for i in rows if i not in running)
        keep = [rows.index(i) for i in running]
        if not running:
            self.merged, self.drafts, self.slots = None, None, []
            return
        for cache in (self.merged, self.drafts):
            for layer in cache:  # type: ignore[union-attr]
                if len(keep) < len(rows):
                    layer.filter(keep)
                drop_tails(layer, rejected)
                trim_layer(layer, list(range(len(keep))))
        self.slots = [*running]

    def _chosen(self, rows: list[int], logits: mx.array, draws: list[int]) -> mx.array:
        """Each row's tokens at the first `draws[j]` of its positions (logits (B, L, V)), drawn
        as mlx-lm's loop draws them: greedy rows by argmax, a sampling row by its sampler over
        those positions in one call (a seeded row's keys follow its positions on, as the one
        sampler mlx-lm's loop shares between drafter and target does); argmax elsewhere."""
        chosen = greedy(logits)
        sampled = [j for j, i in enumerate(rows) if self.samplers[i] is not None and draws[j]]
        for j in sampled:  # rows' draws in row order: unseeded samplers share the global state
            row = logits[j, : draws[j]]
            sampler = self.samplers[rows[j]]
            assert sampler is not None
            drawn = sampler(engine_logprobs(row))
            chosen[j, : draws[j]] = drawn.astype(chosen.dtype).reshape(-1)
        return chosen

    def _round(self, i: int, said: list[int], proposed: list[int], offered: int) -> int | None:
        """Row `i`'s round as mlx-lm's loop runs it: of its `offered` proposals (min(k, tokens
        left)), those the target agrees with, then the target's own token while tokens are left;
        the accepted count, or None once the row finished (its counts then those of the tokens
        it took)."""
        seq = self.seqs[i]
        left = seq.params.max_tokens - len(seq.tokens)
        n = 0
        while n < offered and said[n] == proposed[n]:
            n += 1
        seq.drafted += offered
        for j, token in enumerate(said[: n + 1] if n < left else said[:n]):
            seq.accepted += j < n
            if not self._take([i], [token]):
                return None
        return n


class SpeculativeLane(TextLane):
    """Text rows with the run's text draft model (no logits processor), speculating batched:
    the drafter's proposals and acceptances counted per row."""

    name = "lm-draft"

    def _stream(self, adapter, seqs, eos, decode, watch, width, traits, memory):
        self.models.load_drafter()
        drafter = self.models.drafter
        assert drafter is not None
        draft = LMAdapter(drafter.model)
        batch = SpeculativeBatch(
            adapter, draft, drafter.num_draft_tokens, seqs, eos, decode, watch, width, traits
        )
        return batch.run()


class VisionSpeculativeLane(VisionLane):
    """Rows (media or text) with the run's MTP drafter, on a family whose batched rounds give
    the target's own tokens (`Family.drafts_batch`): batched in mlx-vlm's rounds, a seeded
    row's tokens those of its seed. Planned
    as the vision lane plans (positions, the mRoPE offset), the prompt embedded as mlx-vlm's
    batch_generate embeds it; no prefix or feature reuse (the engine prefills each wave)."""

    name = "vlm-draft"

    def _embedding(self, model: Model, inputs: dict, ids: list[int], digests: list[str]) -> Any:
        return _engine_inputs(model, inputs)

    def _stream(self, adapter, seqs, eos, decode, watch, width, traits, memory):
        self.models.load_drafter()
        model, processor = self.models.vlm()
        drafter = self.models.drafter
        assert drafter is not None
        rounds = EngineRounds(
            adapter, model, processor, drafter, seqs, eos, decode, watch, width, traits, memory
        )
        return rounds.run()


def _engine_inputs(model: Model, inputs: dict) -> Callable[[int, int], tuple[mx.array, dict]]:
    """A row's prompt embedded as mlx-vlm's batch_generate embeds it (the vision tower run on
    first use), with the kwargs its language model reads beside them (grids, mRoPE deltas)."""
    data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    made: list[dict] = []

    def embed(a: int, b: int) -> tuple[mx.array, dict]:
        if not made:
            out = model.get_input_embeddings(
                inputs["input_ids"], inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **data
            )
            made.append({**data, **{k: v for k, v in out.to_dict().items() if v is not None}})
        kwargs = dict(made[0])
        return kwargs.pop("inputs_embeds")[:, a:b], kwargs

    return embed


class EngineRounds(DecodeBatch):
    """Rows speculating in mlx-vlm's batched rounds, a wave at a time (as many rows as the
    width and the memory budget let in): the decoder's rows and stop rules on the tokens the
    engine hands back. A row batchgen ends first (a stop string, a loop, its deadline) is
    taken out of the engine's batch.

    Counts: each round drafts the same block for every row (the drafter's `draft_lens`), and a
    row keeps the tokens it was handed in that round less the target's own closing one; a row
    that ends inside a round keeps at most the round's accepted count (`accept_lens`: one count
    for every row where the target takes one acceptance a round, as Qwen3.5's does)."""

    def __init__(
        self,
        adapter: Adapter,
        model: Model,
        processor: Processor,
        drafter: Drafter,
        seqs: list[Sequence],
        eos: set[int],
        decode: Callable[[list[int]], str],
        watch: Watch | None,
        width: int | None,
        traits: Traits,
        memory: tuple[Memory, Footprint | None] | None,
    ):
        super().__init__(adapter, seqs, eos, decode, None, watch, width, traits, memory)
        self.model, self.processor, self.drafter = model, processor, drafter

    def run(self) -> Iterator[int]:
        """Every row, wave by wave; each row's index as it finishes. A wave holds rows of one
        mRoPE offset (`Sequence.delta`): mlx-vlm's rounds keep the language model's offsets of
        the wave's first rows when a row leaves (its `_rope_deltas` are not filtered with the
        caches), so rows of mixed offsets would take a departed row's positions. And of one
        way of drawing (`draws_of`): the rounds take one sampler, which cannot tell rows apart."""
        while self.waiting:
            first = self.waiting.pop()
            kind = self._kind(first)
            others = [i for i in self.waiting if self._kind(i) != kind]
            self.waiting = others + [i for i in self.waiting if self._kind(i) == kind]
            rows = [first]
            while len(self.waiting) > len(others) and len(rows) < self.width and self._room(rows):
                rows.append(self.waiting.pop())
            yield from self._wave(rows)

    def _kind(self, i: int) -> tuple:
        return self.seqs[i].delta, draws_of(self.seqs[i].params)

    def _wave(self, rows: list[int]) -> Iterator[int]:
        from mlx_vlm.generate.ar import BatchGenerator

        d = self.drafter
        sampler = rounds_sampler(self.seqs[rows[0]].params)
        engine = BatchGenerator(
            self.model.language_model,
            self.processor,
            draft_model=d.model,
            draft_kind=d.kind,
            draft_block_size=d.block_size,
            sampler=sampler,
            greedy_sampling=sampler is None,
            compute_logprobs=False,
            completion_batch_size=len(rows),
            prefill_batch_size=len(rows),
        )
        try:
            yield from self._rounds(engine, rows)
        finally:
            engine.close()

    def _rounds(self, engine: Any, rows: list[int]) -> Iterator[int]:
        start = time.monotonic()
        prompts, kwargs = [], []
        for i in rows:
            seq = self.seqs[i]
            assert seq.embed is not None
            self.deadlines[i] = self.watch.deadline(start)
            embeds, extra = seq.embed(0, len(seq.ids))
            prompts.append(seq.ids)
            kwargs.append({**extra, "inputs_embeds": embeds})
        uids = engine.insert(prompts, [self.seqs[i].params.max_tokens for i in rows], prompt_kwargs=kwargs)
        row_of, uid_of = dict(zip(uids, rows, strict=True)), dict(zip(rows, uids, strict=True))
        running = list(rows)
        got = dict.fromkeys(rows, 0)  # tokens each row was handed in the current round
        head = self.drafter.model
        opened = False  # a round has begun (the first token is the target's, from the prompt)
        while running and engine.has_work:
            self.watch.check_stop()
            before = _rounds_of(head)
            _, responses = engine.next()
            if _rounds_of(head) != before:  # this step opens a round: the one before is closed
                for i in running:
                    self.seqs[i].accepted += max(got[i] - 1, 0)
                    self.seqs[i].drafted += int(head.draft_lens[-1])
                    got[i] = 0
                opened = True
            taken = [
                (row_of[r.uid], r) for r in responses if r.token is not None and row_of[r.uid] in running
            ]
            if taken and self.memory is not None:
                self.memory[0].step(len(running))
            for i, response in taken:
                got[i] += 1
                if self._take([i], [int(response.token)]):
                    continue
                running.remove(i)
                if opened:
                    self.seqs[i].accepted += min(got[i], round(head.accept_lens[-1]))
                if response.finish_reason is None:  # ended by batchgen's rules: out of the engine's batch
                    engine.remove(uid_of[i])
                yield i
        for i in running:  # the engine stopped them without a token (its rounds ran out)
            seq = self.seqs[i]
            seq.finish_reason, seq.text = (
                "length",
                final_text(seq.tokens, self.eos, seq.params.stop, self.decode),
            )
            yield i


def _rounds_of(drafter: Model) -> int:
    """The drafter's lifetime count of speculative rounds (mlx-vlm's per-request attribution)."""
    return int(getattr(drafter, "speculative_total_rounds", 0))

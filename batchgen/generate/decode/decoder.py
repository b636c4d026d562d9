"""Batched generation with prompt-prefix reuse: the MLX core under the router (router.py).

Each row is a `Sequence` fed through its family's `Adapter` (adapters.py). Rows are
prefilled one at a time up to their tails (prefill.py), resuming from the longest cached
prefix; rows joining together then feed their tails in shared forward passes, and all rows
of the batch decode together in one left-padded KV cache, each with its own sampler,
penalties, output constraint, stop rules and positions; a row that joins later is written
into the slot a finished row left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import mlx.core as mx

from ..base.arrays import Cache, ints, scalar
from ..base.watch import Watch
from ..chat.reasoning import thinking_of
from ..chat.traits import Traits
from .adapters import Adapter, Sequence
from .batch_cache import SLOT_CACHES, KVQuant, in_place, trim_layer, write_slots
from .memory import Footprint, Memory, wired
from .prefill import feed_tails, prefill
from .prefix_cache import PrefixCache
from .sampling import (
    HISTORY,
    Loops,
    Seeded,
    engine_logprobs,
    final_text,
    greedy,
    hit_stop,
    logits_processors_for,
    sampler_for,
    token_logprobs,
)

__all__ = ["decode_stream", "DecodeBatch"]


def decode_stream(
    adapter: Adapter,
    seqs: list[Sequence],
    eos: set[int],
    decode: Callable[[list[int]], str],
    prefixes: PrefixCache | None = None,
    watch: Watch | None = None,
    width: int | None = None,
    traits: Traits | None = None,
    memory: tuple[Memory, Footprint | None] | None = None,
    kv: KVQuant | None = None,
) -> Iterator[int]:
    """Generate every sequence, at most `width` at a time (continuous batching): when a row
    finishes, the next waiting one is prefilled from its longest cached prefix and joins the
    running batch at the next step, so no slot idles while rows wait. Yields each row's index
    as it finishes, with its tokens, text, finish_reason and cached_tokens filled in.

    `memory`: the run's budget and the model's row footprint; rows then join only while the
    batch fits it (a row alone always runs), so long rows run narrow and short ones wide.
    `kv`: every row's cache quantized as mlx-lm's generate quantizes it (rows whose `fate`
    is `quantized`), decoding in one quantized batch cache.

    A seeded sampled row draws with its own key per position (sampling.Seeded), so it batches
    with any rows and its tokens do not depend on them. Rows past the watch's timeout (from their own
    prefill) end with finish reason "timeout"; a stop request raises StopRequested between
    steps, whatever is running.
    """
    batch = DecodeBatch(adapter, seqs, eos, decode, prefixes, watch, width, traits, memory, kv)
    with wired():
        while batch.active or batch.waiting:
            yield from batch.join()
            if batch.active:
                yield from batch.step()


class DecodeBatch:
    """The state of one continuous batch, in the manner of mlx-lm's BatchGenerator: rows
    waiting, rows running in the slots of one left-padded batch cache per layer, and each
    row's sampling rules. `join` prefills waiting rows into free slots, `step` decodes one
    token for every running row, `pick` samples and decides who finished.

    A finished row's slot is not cut out of the cache (a copy of every row's keys and values):
    it idles until a joining row is written into it in place, right-aligned with the others.
    Only when no row waits are idle slots dropped. Caches that cannot take a row in place
    (sliding windows, linear attention) drop idle slots before each join instead.
    """

    def __init__(
        self,
        adapter: Adapter,
        seqs: list[Sequence],
        eos: set[int],
        decode: Callable[[list[int]], str],
        prefixes: PrefixCache | None,
        watch: Watch | None,
        width: int | None,
        traits: Traits | None,
        memory: tuple[Memory, Footprint | None] | None = None,
        kv: KVQuant | None = None,
    ):
        self.adapter, self.seqs, self.eos, self.decode, self.prefixes = adapter, seqs, eos, decode, prefixes
        self.memory, self.kv = memory, kv
        self.watch = watch or Watch()
        self.width = width or len(seqs)
        self.samplers = [sampler_for(s.params) for s in seqs]
        self.processors = [logits_processors_for(s.params, traits, eos, s.part) for s in seqs]
        self.thinking = [thinking_of(procs) for procs in self.processors]
        self.deadlines = [float("inf")] * len(seqs)
        for s in seqs:
            s.loops = Loops(s.params.stop_repetition) if s.params.stop_repetition else None
        self.waiting = list(range(len(seqs)))[::-1]  # popped from the end: in the order given
        self.slots: list[int | None] = []  # the row in each row of `merged`; None: finished, free
        self.merged: Cache | None = None  # one left-padded batch cache per layer
        # A pipelined step's tokens, one per slot: drawn on the device, not yet read or taken
        # into `seq.tokens` (their keys and values not yet in the cache).
        self.ahead: mx.array | None = None
        self.ahead_logits: mx.array | None = None  # ... and the logits they were drawn from (logprobs rows)

    @property
    def active(self) -> list[int]:
        return [i for i in self.slots if i is not None]

    @property
    def live(self) -> list[int]:
        """The slots holding a running row."""
        return [s for s, i in enumerate(self.slots) if i is not None]

    def join(self) -> Iterator[int]:
        """Prefill waiting rows into the free slots (again if rows ended at their first token);
        yields the rows that finished there. Tokens drawn ahead are taken first: a joining row
        needs every row's cache as its tokens say."""
        if self.ahead is not None and self.waiting and len(self.active) < self.width and self._room([]):
            yield from self._drain()
        while self.waiting and len(self.active) < self.width and self._room([]):
            prefilled: list[tuple[int, Cache, int]] = []
            while (
                self.waiting
                and len(self.active) + len(prefilled) < self.width
                and self._room([i for i, *_ in prefilled])
            ):
                i = self.waiting.pop()
                self.deadlines[i] = self.watch.deadline(time.monotonic())
                filled = prefill(self.adapter, self.seqs[i], self.prefixes, self.watch, self.kv)
                prefilled.append((i, *filled))
            for rows, logits, batch in feed_tails(self.adapter, self.seqs, prefilled):
                joined = self.pick(rows, logits)
                yield from (i for i in rows if i not in joined)
                if joined:
                    if len(joined) < len(rows):
                        for c in batch:
                            c.filter([rows.index(i) for i in joined])
                    self._place(joined, batch)
        self._tidy()

    def _room(self, joining: list[int]) -> bool:
        """Whether the next waiting row fits the memory budget beside the running rows and those
        `joining` with it (a row that would run alone always does)."""
        if self.memory is None:
            return True
        memory, fp = self.memory
        rows = [*self.active, *joining, self.waiting[-1]]
        lengths = [len(self.seqs[i].ids) + self.seqs[i].params.max_tokens for i in rows]
        return memory.fits(fp, lengths, len(self.seqs[rows[-1]].ids), alone=len(rows) == 1)

    def _place(self, rows: list[int], batch: Cache) -> None:
        """Joining rows' caches into the batch: into idle slots in place where the caches allow,
        appended after the others where no slot is idle."""
        free = [s for s, i in enumerate(self.slots) if i is None]
        if free and not all(in_place(c, more) for c, more in zip(self.merged or [], batch, strict=True)):
            self._compact()
            free = []
        if self.merged is None:
            self.merged, self.slots = batch, list(rows)
            return
        into = free[: len(rows)]
        if into:
            for layer, more in zip(self.merged, batch, strict=True):
                write_slots(layer, more, list(range(len(into))), into)
            for s, i in zip(into, rows, strict=False):
                self.slots[s] = i
        if len(rows) > len(into):
            rest = list(range(len(into), len(rows)))
            for layer, more in zip(self.merged, batch, strict=True):
                if into:
                    more.filter(rest)
                layer.extend(more)
            self.slots += rows[len(into) :]
        if into:
            self._trim()

    def step(self) -> Iterator[int]:
        """One decode step for every running row; yields the rows that finished. Where every
        running row draws on the device alone (no logits processor), the step is pipelined as
        mlx-lm's generate pipelines it: the next step is queued (`mx.async_eval`) before the
        host reads this one's tokens (and a logprobs row's records), so the host's checks and
        the next graph's building overlap the device's work; a finished row's queued step is
        dropped."""
        self.watch.check_stop()
        live = self.live
        rows = [i for i in (self.slots[s] for s in live) if i is not None]  # live slots hold rows
        ahead, ahead_logits = self.ahead, self.ahead_logits
        pipelined = ahead is not None or all(self._on_device(i) for i in rows)
        if ahead is None:
            tokens = mx.array([self.seqs[i].tokens[-1] if i is not None else 0 for i in self.slots])
        seqs = [self.seqs[i] if i is not None else None for i in self.slots]
        fed = ahead if ahead is not None else tokens
        assert self.merged is not None, "a decode step with no rows in the batch"
        every = self.adapter.decode(fed, self.merged, seqs, int(ahead is not None))
        logits = every[mx.array(live)] if len(live) < len(self.slots) else every
        if self.memory is not None:
            self.memory[0].step(len(live))
        if pipelined:
            drawn = self._draw(rows, logits)
            if len(live) < len(self.slots):
                drawn = mx.zeros((len(self.slots),), dtype=drawn.dtype).at[mx.array(live)].add(drawn)
            self.ahead = drawn
            self.ahead_logits = every if any(self.seqs[i].params.wants_logprobs for i in rows) else None
            mx.async_eval(drawn, *([every] if self.ahead_logits is not None else []))
            if ahead is None:
                return
            running = set(self._take_ahead(rows, live, ahead, ahead_logits))
        else:
            mx.eval(logits)
            running = set(self.pick(rows, logits))
        if len(running) < len(rows):
            yield from self._leave(rows, running)
            self._tidy()

    def _leave(self, rows: list[int], running: set[int]) -> Iterator[int]:
        """The rows of `rows` no longer running, yielded, their slots freed."""
        yield from (i for i in rows if i not in running)
        self.slots = [i if i in running else None for i in self.slots]

    def _on_device(self, i: int) -> bool:
        """Whether row `i` draws its tokens without the host: no logits processor."""
        return not self.processors[i]

    def _take_ahead(
        self, rows: list[int], live: list[int], ahead: mx.array, logits: mx.array | None
    ) -> list[int]:
        """The tokens drawn ahead for the live slots taken (a logprobs row's records first, from
        the logits they were drawn from); the rows still running."""
        every = ints(ahead)
        picked = [every[s] for s in live]
        if logits is not None:
            self._logprobs(rows, picked, lambda want: logits[mx.array([live[j] for j in want])])
        return self._take(rows, picked)

    def _draw(self, rows: list[int], logits: mx.array) -> mx.array:
        """Each row's next token, drawn on the device as `pick` draws it (no host read)."""
        if all(self.samplers[i] is None for i in rows):
            return greedy(logits)
        logprobs = engine_logprobs(logits)
        groups: dict[object, list[int]] = {}  # greedy rows, each seeded recipe, each other sampler
        for j, i in enumerate(rows):
            sampler = self.samplers[i]
            key = None if sampler is None else sampler.recipe if isinstance(sampler, Seeded) else sampler
            groups.setdefault(key, []).append(j)
        drawn = mx.zeros((len(rows),), dtype=mx.uint32)
        for js in groups.values():
            at = mx.array(js)
            sampler = self.samplers[rows[js[0]]]
            if sampler is None:
                values = greedy(logits[at])
            elif isinstance(sampler, Seeded):  # and so is every sampler of its group
                seeded = [s for j in js if isinstance(s := self.samplers[rows[j]], Seeded)]
                values = Seeded.draw(seeded, logprobs[at])
            else:
                values = sampler(logprobs[at])
            drawn = drawn.at[at].add(values.astype(mx.uint32).reshape(-1))
        return drawn

    def _drain(self) -> Iterator[int]:
        """The tokens drawn ahead, read and taken: every row's tokens on the host again."""
        ahead, logits, self.ahead, self.ahead_logits = self.ahead, self.ahead_logits, None, None
        assert ahead is not None
        live = self.live
        rows = [i for i in (self.slots[s] for s in live) if i is not None]
        running = set(self._take_ahead(rows, live, ahead, logits))
        if len(running) < len(rows):
            yield from self._leave(rows, running)

    def _tidy(self) -> None:
        """Idle slots with no row left to fill them are dropped at once (a copy of the running
        rows' caches): computing a dead row costs more than the copy on a slow matmul."""
        if not self.waiting and None in self.slots:
            self._compact()

    def _compact(self) -> None:
        """Drop the idle slots (every running row's cache copied once)."""
        keep = self.live
        if not keep:
            self.merged, self.slots, self.ahead, self.ahead_logits = None, [], None, None
            return
        for c in self.merged or []:
            c.filter(keep)
        if self.ahead is not None:
            self.ahead = self.ahead[mx.array(keep)]
        if self.ahead_logits is not None:
            self.ahead_logits = self.ahead_logits[mx.array(keep)]
        self.slots = [self.slots[s] for s in keep]

    def _trim(self) -> None:
        """Cut the columns no running row attends to (a view, no copy): attention then spans
        the longest running row, not the longest row the batch has held."""
        live = self.live
        for layer in self.merged or []:
            if isinstance(layer, SLOT_CACHES):
                trim_layer(layer, live)

    def pick(self, rows: list[int], logits: mx.array) -> list[int]:
        """Sample each row's next token and return the rows still running."""
        if all(self.samplers[i] is None and not self.processors[i] for i in rows):
            picked, shaped = ints(greedy(logits)), None
        else:
            picked, shaped = self._sampled(rows, logits)

        def drawn_from(want: list[int]) -> mx.array:
            return logits[mx.array(want)] if shaped is None else mx.concatenate([shaped[j] for j in want])

        self._logprobs(rows, picked, drawn_from)
        return self._take(rows, picked)

    def _logprobs(
        self, rows: list[int], picked: list[int], logits_of: Callable[[list[int]], mx.array]
    ) -> None:
        """The logprobs records of the rows that ask for them: `logits_of` gives the logits those
        rows' tokens were drawn from, by their places in `rows`."""
        want = [j for j, i in enumerate(rows) if self.seqs[i].params.wants_logprobs]
        if not want:
            return
        ks = [self.seqs[rows[j]].params.top_logprobs for j in want]
        records = token_logprobs(logits_of(want), [picked[j] for j in want], ks)
        for j, record in zip(want, records, strict=True):
            self.seqs[rows[j]].logprobs.append(record)

    def _take(self, rows: list[int], picked: list[int]) -> list[int]:
        """Each row's next token taken: appended, its stop rules checked; the rows still running."""
        seqs = self.seqs
        now = time.monotonic()
        running = []
        for i, token in zip(rows, picked, strict=True):
            seq = seqs[i]
            seq.tokens.append(token)
            if token in self.eos:
                seq.finish_reason = "stop"
            elif seq.params.stop and hit_stop(seq.tokens, seq.params.stop, self.decode):
                seq.finish_reason = "stop"
            elif seq.loops is not None and (keep := seq.loops.cut(seq.tokens)) is not None:
                seq.finish_reason = "repetition"
                seq.text = final_text(seq.tokens[:keep], self.eos, seq.params.stop, self.decode)
                continue
            elif len(seq.tokens) >= seq.params.max_tokens or self._answered(i, token):
                seq.finish_reason = "length"
            elif now > self.deadlines[i]:
                seq.finish_reason = "timeout"
            else:
                running.append(i)
                continue
            seq.text = final_text(seq.tokens, self.eos, seq.params.stop, self.decode)
        return running

    def _answered(self, i: int, token: int) -> bool:
        """A budgeted row's answer has its max_tokens (counted from its end marker)."""
        thinking = self.thinking[i]
        return thinking is not None and thinking.answer_full(len(self.seqs[i].tokens), token)

    def _sampled(self, rows: list[int], logits: mx.array) -> tuple[list[int], list[mx.array]]:
        """Each row's processors on its own logits, then one evaluation for the greedy rows;
        the picks and the logits they were picked from."""
        shaped = []
        for j, i in enumerate(rows):
            row = logits[j : j + 1]
            if self.processors[i]:
                history = mx.array((self.seqs[i].ids + self.seqs[i].tokens)[-HISTORY:])
                for proc in self.processors[i]:
                    row = proc(history, row)
            shaped.append(row)
        plain = [j for j, i in enumerate(rows) if self.samplers[i] is None]  # greedy rows
        picked = [0] * len(rows)
        if plain:
            best = ints(greedy(mx.concatenate([shaped[j] for j in plain])))
            for j, token in zip(plain, best, strict=True):
                picked[j] = token
        recipes: dict[tuple, list[tuple[int, Seeded]]] = {}  # seeded rows of one recipe draw together
        for j, i in enumerate(rows):
            sampler = self.samplers[i]
            if isinstance(sampler, Seeded):
                recipes.setdefault(sampler.recipe, []).append((j, sampler))
            elif sampler is not None:
                row = shaped[j]
                picked[j] = scalar(sampler(engine_logprobs(row)))
        for group in recipes.values():
            both = mx.concatenate([shaped[j] for j, _ in group])
            drawn = Seeded.draw([s for _, s in group], engine_logprobs(both))
            for (j, _), token in zip(group, ints(drawn), strict=True):
                picked[j] = token
        return picked, shaped

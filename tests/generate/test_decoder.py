"""decode_stream on the tiny text checkpoint: batching and prefix reuse leave greedy tokens
unchanged; a stop request and a deadline end generation between steps."""

from __future__ import annotations

import hashlib
import threading

import pytest
from conftest import MODELS

from batchgen.core.errors import StopRequested
from batchgen.core.params import GenParams
from batchgen.generate.base.watch import Watch
from batchgen.generate.decode.adapters import LMAdapter, Sequence
from batchgen.generate.decode.decoder import decode_stream
from batchgen.generate.decode.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def lm():
    import mlx_lm

    return mlx_lm.load(str(MODELS / "tiny-lm"))


SYSTEM = "You answer in one short sentence about the weather and nothing else at all."
QUESTIONS = ["Is it raining?", "Will it snow tomorrow in the hills?", "Wind?"]


def _seqs(tokenizer, max_tokens: int = 12) -> list[Sequence]:
    params = GenParams(max_tokens=max_tokens, temperature=0.0)
    prefix = tokenizer.encode(SYSTEM, add_special_tokens=False)
    key = hashlib.sha256(str(prefix).encode()).hexdigest()
    seqs = []
    for q in QUESTIONS:
        ids = prefix + tokenizer.encode(" " + q, add_special_tokens=False)
        seqs.append(Sequence(ids=ids, params=params, boundaries=[(len(prefix), key)]))
    return seqs


def _run(lm, seqs, prefixes=None, watch=None):
    model, tokenizer = lm
    list(
        decode_stream(LMAdapter(model), seqs, set(tokenizer.eos_token_ids), tokenizer.decode, prefixes, watch)
    )
    return [s.tokens for s in seqs]


def test_batched_and_reused_prefixes_give_the_tokens_of_one_row_at_a_time(lm):
    alone = [_run(lm, [s])[0] for s in _seqs(lm[1])]
    assert len({tuple(t) for t in alone}) > 1  # the rows differ: a position bug would show
    prefixes = PrefixCache()
    seqs = _seqs(lm[1])
    assert _run(lm, seqs, prefixes) == alone
    assert [s.cached_tokens > 0 for s in seqs] == [False, True, True]
    assert prefixes.stats().prefix_hits == 2


def test_a_stop_request_raises_between_steps(lm):
    watch = Watch(stop=threading.Event())
    watch.stop.set()
    with pytest.raises(StopRequested):
        _run(lm, _seqs(lm[1]), watch=watch)


def test_rows_past_the_deadline_end_with_timeout(lm):
    seqs = _seqs(lm[1], max_tokens=10_000)
    _run(lm, seqs, watch=Watch(timeout=-1))
    assert [s.finish_reason for s in seqs] == ["timeout"] * 3
    assert all(len(s.tokens) == 1 for s in seqs)


class _Counting(LMAdapter):
    """Records how many rows each decode step ran."""

    def __init__(self, model):
        super().__init__(model)
        self.widths: list[int] = []

    def decode(self, tokens, cache, seqs, ahead=0):
        self.widths.append(sum(s is not None for s in seqs))
        return super().decode(tokens, cache, seqs, ahead)


def test_finished_rows_slots_go_to_waiting_rows_with_the_tokens_of_one_row_at_a_time(lm):
    """Continuous batching: rows of mixed lengths and budgets join a running batch as others
    finish, each at its own positions; greedy tokens are those of each row alone."""
    model, tokenizer = lm
    budgets = [1, 40, 3, 17, 8, 25, 2, 12]
    prompts = [SYSTEM * (k % 3 + 1) + " " + QUESTIONS[k % 3] * (k + 1) for k in range(len(budgets))]

    def seqs():
        return [
            Sequence(
                ids=tokenizer.encode(p, add_special_tokens=False),
                params=GenParams(max_tokens=m, temperature=0.0),
            )
            for p, m in zip(prompts, budgets, strict=True)
        ]

    alone = [_run(lm, [s])[0] for s in seqs()]
    assert len({tuple(t) for t in alone}) == len(alone)
    eos = set(tokenizer.eos_token_ids)
    rows = seqs()
    adapter = _Counting(model)
    order = list(decode_stream(adapter, rows, eos, tokenizer.decode, PrefixCache(), width=3))
    assert sorted(order) == list(range(len(rows))) and order != sorted(order)  # as they finish
    assert [s.tokens for s in rows] == alone
    # Three slots stay busy while rows wait: no step runs fewer rows until the queue is empty.
    steps_to_drain = len(adapter.widths) - adapter.widths[::-1].index(3)
    assert set(adapter.widths[:steps_to_drain]) == {3}
    static = _Counting(model)
    rows = seqs()
    for k in range(0, len(rows), 3):
        list(decode_stream(static, rows[k : k + 3], eos, tokenizer.decode))  # one static batch
    assert [s.tokens for s in rows] == alone
    assert sum(static.widths) == sum(adapter.widths)  # the same tokens decoded, ...
    assert len(static.widths) > len(adapter.widths)  # ... in more (emptier) steps when static


class _Ahead(LMAdapter):
    """Records whether each decode step fed tokens drawn ahead (a pipelined step)."""

    def __init__(self, model):
        super().__init__(model)
        self.ahead: list[int] = []

    def decode(self, tokens, cache, seqs, ahead=0):
        self.ahead.append(ahead)
        return super().decode(tokens, cache, seqs, ahead)


def test_pipelined_steps_take_the_tokens_of_steps_read_at_once(lm, monkeypatch):
    """Greedy and seeded rows of mixed budgets, some with logprobs, three slots, rows waiting:
    the next step is queued before the host reads this one (joins take the tokens drawn ahead
    first, finished rows' queued steps are dropped), and every row's tokens, logprobs and finish
    reason are those of the same batch read step by step."""
    from batchgen.generate.decode.decoder import DecodeBatch

    model, tokenizer = lm
    eos = set(tokenizer.eos_token_ids)
    budgets = [1, 30, 3, 17, 8, 25, 2, 12, 40]

    def seqs():
        return [
            Sequence(ids=tokenizer.encode(f"{SYSTEM} {QUESTIONS[k % 3]} {k}", add_special_tokens=False),
                     params=GenParams(max_tokens=m, temperature=0.8 if k % 2 else 0.0,
                                      seed=k if k % 2 else None, top_logprobs=2 * (k % 3 == 0)))
            for k, m in enumerate(budgets)
        ]  # fmt: skip

    def run(adapter, width):
        rows = seqs()
        order = list(decode_stream(adapter, rows, eos, tokenizer.decode, PrefixCache(), width=width))
        return order, [(s.tokens, s.finish_reason, s.text, s.logprobs) for s in rows]

    # three slots with rows waiting (joins); every row at once (finished rows' slots cut)
    for width in (3, len(budgets)):
        pipelined = _Ahead(model)
        order, got = run(pipelined, width)
        with monkeypatch.context() as m:
            m.setattr(DecodeBatch, "_on_device", lambda self, i: False)
            stepwise = _Ahead(model)
            want_order, want = run(stepwise, width)
        assert got == want and sorted(order) == sorted(want_order) == list(range(len(budgets)))
        assert set(stepwise.ahead) == {0} and pipelined.ahead.count(1) > len(pipelined.ahead) // 2
        assert len({tuple(t) for t, *_ in want}) == len(budgets)  # the rows differ: a shift would show


@pytest.mark.slow  # long rows through every way out (2 s)
def test_the_wired_limit_is_raised_while_a_batch_decodes_and_put_back_on_every_way_out(lm, monkeypatch):
    import mlx.core as mx

    model, tokenizer = lm
    limits: list[int] = []
    current = [777]

    def set_wired_limit(n):
        limits.append(n)
        current[0], old = n, current[0]
        return old

    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 12345})
    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    eos = set(tokenizer.eos_token_ids)
    list(decode_stream(LMAdapter(model), _seqs(tokenizer), eos, tokenizer.decode))
    assert limits == [12345, 777] and current == [777]
    # a stop request mid-batch, and a consumer that stops reading: put back all the same
    watch = Watch(stop=threading.Event())
    watch.stop.set()
    with pytest.raises(StopRequested):
        list(decode_stream(LMAdapter(model), _seqs(tokenizer, 500), eos, tokenizer.decode, watch=watch))
    stream = decode_stream(LMAdapter(model), _seqs(tokenizer, 500), eos, tokenizer.decode)
    next(stream)
    stream.close()
    assert limits == [12345, 777] * 3 and current == [777]

"""The local executor: jobs → media look-ahead → batched generation → results.

`LocalExecutor` is the loop a local run drives and each Ray actor runs on its share of the
rows (ray.py), so media overlap generation and rows are grouped over the window in both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..core.constraints import answer_kinds, satisfied
from ..core.errors import RowError, one_line, plural
from ..core.records import TOTALS, Finished, Generation, Job, Media, MemoryStats, Result
from ..core.settings import RunConfig, WorkSettings
from ..generate.lanes import completions
from ..generate.router import Engines, Plan
from ..generate.schedule import schedule
from ..input.parse import near_miss, parse_row
from ..input.plan import Grouping
from ..input.read import RawRow, id_key
from ..media.resolve import MediaStage, Prefetcher, Prepared
from ..output.resume import Pending
from .executor import Executor, ExecutorStats

__all__ = ["LocalExecutor", "generate_window"]

FIRST_WINDOW_PATIENCE = 1.0  # seconds the first window waits for rows whose media are resolving

log = logging.getLogger(__name__)


_CONSTRAINT_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "tool_call": "tool_choice"}


def _result(
    job: Job,
    prepared: Prepared | None,
    outcome: Generation | RowError,
    model: str | None,
    generate_ms: float = 0.0,
) -> Result:
    """One output row from a job, its media stage times and what generation made of it."""
    result = Result(id=job.id, model=model, generate_ms=generate_ms, input_hash=job.digest)
    constraint = job.params.constraint
    if constraint is not None and (kinds := answer_kinds(constraint)):  # failed rows too: the columns exist
        result.answer_kinds = json.dumps(kinds)
    if prepared is not None:
        t = prepared.times
        result.fetch_ms, result.decode_ms, result.frames_ms = t.fetch_ms, t.decode_ms, t.frames_ms
        result.media_files = [dataclasses.asdict(f) for f in prepared.files]
    if isinstance(outcome, RowError):
        result.status, result.error, result.error_stage = "error", one_line(outcome.message), outcome.stage
        result.transient = outcome.transient
    else:
        result.generated_text, result.finish_reason = outcome.text, outcome.finish_reason
        result.reasoning, result.tool_calls = outcome.reasoning, outcome.tool_calls
        result.logprobs, result.choice_scores = outcome.logprobs, outcome.choice_scores
        result.score_logprob, result.score_mean, result.score_tokens = (
            outcome.score_logprob, outcome.score_mean, outcome.score_tokens)  # fmt: skip
        for name in TOTALS:
            setattr(result, name, getattr(outcome, name))
        if constraint is not None:  # never output that misses its constraint marked ok
            try:
                result.parsed, why = satisfied(constraint, outcome.text, outcome.tool_calls)
            except Exception as e:  # noqa: BLE001 - a hostile constraint fails its row, never the run
                result.parsed, why = None, f"could not be checked ({type(e).__name__})"
            if why:
                cut = (
                    f" within max_tokens {job.params.max_tokens}" if outcome.finish_reason == "length" else ""
                )
                what = {
                    "json_schema": "JSON schema",
                    "json_object": "JSON object",
                    "tool_call": "tool_choice",
                }.get(constraint.kind, constraint.kind)
                result.status, result.error_stage = "error", "generate"
                result.error = (
                    f"the output {why}: it does not satisfy its {what}{cut} "
                    f"(finish_reason {outcome.finish_reason})"
                )
    return result


def _combined(outcomes: list[Generation | RowError]) -> tuple[Generation | RowError, str | None]:
    """A row's n completions (OpenAI's `n`) as one outcome: the first's text, all tokens
    counted, every completion in `choices`; any failure fails the row."""
    if len(outcomes) == 1:
        return outcomes[0], None
    gens = [o for o in outcomes if isinstance(o, Generation)]
    if len(gens) < len(outcomes):
        return next(o for o in outcomes if isinstance(o, RowError)), None
    first = dataclasses.replace(
        gens[0], completion_tokens=sum(g.completion_tokens for g in gens),
        reasoning_tokens=sum(g.reasoning_tokens for g in gens),
        mtp_drafts=sum(g.mtp_drafts for g in gens), mtp_accepted=sum(g.mtp_accepted for g in gens),
        capped=any(g.capped for g in gens),
    )  # fmt: skip
    choices = [{"text": g.text, "finish_reason": g.finish_reason, "completion_tokens": g.completion_tokens,
                **({"reasoning": g.reasoning} if g.reasoning is not None else {}),
                **({"tool_calls": g.tool_calls} if g.tool_calls else {}),
                **({"logprobs": g.logprobs} if g.logprobs is not None else {})} for g in gens]  # fmt: skip
    return first, json.dumps(choices)


def generate_window(
    window: list[tuple[Job, Prepared | None]], engines: Engines, batch_size: int, continuous: bool = True
) -> Iterator[list[tuple[Job, Result]]]:
    """Results for a window of rows, a list at a time: the rows that failed before generation,
    then the rows of each scheduled run as they finish, `batch_size` at a time. With
    `continuous`, a lane's rows are one run (a finished row's slot goes to the next waiting
    row); without, static batches of `batch_size`. A batched row's `generate_ms` is its share
    of the lane's time: the time since the run's previous row finished. A row asking for n
    completions runs as n rows of one prompt and comes out once, when all n are done."""
    plans: list[Plan] = []
    owners: list[int] = []  # each plan's row in the window
    failed: list[tuple[Job, Result]] = []
    for w, (job, prepared) in enumerate(window):
        if job.error:
            failed.append((job, _result(job, prepared, RowError("read", job.error), None)))
        elif prepared is not None and prepared.error:
            failed.append((job, _result(job, prepared, prepared.error, None)))
        else:
            t0 = time.perf_counter()
            try:
                copies = completions(engines.plan(job, prepared.media if prepared else Media()))
            except RowError as e:
                ms = (time.perf_counter() - t0) * 1000
                failed.append((job, _result(job, prepared, e, engines.model_for(job), ms)))
                continue
            plans += copies
            owners += [w] * len(copies)
    if failed:
        yield failed
    outcomes: dict[int, list[tuple[int, Generation | RowError]]] = {}
    spent: dict[int, float] = {}
    for run in schedule(plans, None if continuous else batch_size):
        members = [plans[i] for i in run]
        done: list[tuple[Job, Result]] = []
        last = started = time.perf_counter()
        tokens = 0
        for i, outcome in engines.run(members, batch_size):
            now, w = time.perf_counter(), owners[run[i]]
            got = outcomes.setdefault(w, [])
            got.append((run[i], outcome))
            spent[w] = spent.get(w, 0.0) + (now - last) * 1000
            last = now
            job, prepared = window[w]
            if len(got) < job.params.completions:
                continue
            outcome, choices = _combined([o for _, o in sorted(got, key=lambda x: x[0])])
            result = _result(job, prepared, outcome, engines.model_for(job), spent.pop(w))
            result.choices = choices
            tokens += result.completion_tokens
            done.append((job, result))
            del outcomes[w]
            if len(done) >= batch_size:
                yield done
                done = []
        if log.isEnabledFor(logging.DEBUG):
            lane = members[0].lane.name if members else "-"
            log.debug("lane %s: %d rows, %d completion tokens in %.1f s", lane, len(members), tokens,
                      time.perf_counter() - started)  # fmt: skip
        if done:
            yield done


class LocalExecutor(Executor):
    """Raw rows in, results out, a list at a time: rows are parsed, their media resolve in
    worker threads up to a window ahead, and each window is generated in scheduled batches.
    A set `stop` ends the wait for media at once and generation between decode steps
    (StopRequested); the caller commits what came out before."""

    def __init__(self, config: RunConfig, work: WorkSettings, engines: Engines, tmp_dir: Path,
                 stop: threading.Event):  # fmt: skip
        super().__init__(config, work, engines, tmp_dir, stop)
        info = engines.vision_info
        self.stage = MediaStage(work.media, work.base_dir, tmp_dir, info.audio, info.max_pixels, stop)
        self.pool = ThreadPoolExecutor(work.media.fetch_workers, thread_name_prefix="batchgen-media")
        engines.stop = stop
        engines.load_drafter()  # a drafter that cannot pair with its target stops the run before any row
        self.unused_media: dict[str, int] = {}  # rows without media beside a column that looks like media
        self.near_misses: dict[str, int] = {}  # rows with a field one slip from a field of ours
        self.said_model = False  # an OpenAI Batch file's body.model, said once
        self.looped: frozenset[str] = frozenset()  # rows to generate again with --redo-repetition's penalty

    def _redone(self, job: Job) -> Job:
        """A row the loop stop ended in an earlier run, with --redo-repetition's penalty."""
        redo = self.config.redo_repetition
        if redo is not None and self.looped and not job.error and id_key(job.id) in self.looped:
            job.params = dataclasses.replace(job.params, repetition_penalty=redo)
        return job

    def _counted(self, job: Job) -> Job:
        for name in job.unused_media:
            self.unused_media[name] = self.unused_media.get(name, 0) + 1
        if job.asked_model and not self.said_model:
            self.said_model = True
            log.warning("%s: body.model %r is not used: the rows run on %s", job.where, job.asked_model[:80],
                        self.engines.model_for(job))  # fmt: skip
        for name in job.near_misses:
            if name not in self.near_misses:  # the first row with it: said at once, counted at the end
                log.warning("%s: field %r is not one batchgen reads; did you mean %r? (kept as data)",
                            job.where, name, near_miss(name))  # fmt: skip
            self.near_misses[name] = self.near_misses.get(name, 0) + 1
        return job

    def run(self, todo: Pending) -> Generator[list[Finished], None, None]:
        self.looped = todo.looped
        rows = todo.rows()
        if self.config.plan_horizon:  # rows sharing a picture or prefix brought together over the job
            grouping = Grouping(todo.index, todo.done)
            f = grouping.figures
            log.info("plan: %s to do, %s in %s sharing a picture or prefix (largest %s), %s alone",
                     plural(f.rows, "row"), f"{f.grouped:,}", plural(f.groups, "group"), f"{f.largest:,}",
                     f"{f.alone:,}")  # fmt: skip
            rows = grouping.ordered(rows, self.config.plan_horizon * 2**20, self.work.window)
        return self.generate(rows)

    def generate(self, rows: Iterable[RawRow]) -> Generator[list[Finished], None, None]:
        """Finished rows for these raw rows (a Ray actor's share, or the pending rows here)."""
        c = self.work
        parsed = (parse_row(raw, c.defaults, c.prompt_template, c.columns)[0] for raw in rows)
        jobs = (self._counted(self._redone(job)) for job in parsed)
        prefetcher = Prefetcher(jobs, self.stage, self.pool, c.window, stop=self.stop)
        prefetcher.start()
        # Load the models the first rows need while their media download.
        queued = [job for job, _ in prefetcher.ahead if not job.error]
        self.engines.load(vision=any(j.media for j in queued), text=any(not j.media for j in queued))
        # The first window starts with a quarter of a batch, after waiting a moment for more
        # (local files decode in it; a slow network does not hold generation back for long):
        # rows split over windows would decode in narrower batches.
        least, patience = max(1, c.batch_size // 4), FIRST_WINDOW_PATIENCE
        while not self.stop.is_set() and (window := prefetcher.take(c.window, least, patience)):
            if self.stop.is_set():  # a download the stop cut short is no row's failure: the rows run again
                return
            least, patience = c.batch_size, 0.0
            log.debug("window: %d rows (%d with media, %d failed before generation)", len(window),
                      sum(bool(job.media) for job, _ in window),
                      sum(bool(job.error or (p is not None and p.error)) for job, p in window))  # fmt: skip
            for done in generate_window(window, self.engines, c.batch_size, c.continuous):
                yield [Finished(job.raw, job.where, result) for job, result in done]

    def stats(self) -> ExecutorStats:
        prefixes, memory = self.engines.prefixes, self.engines.memory
        return ExecutorStats(
            self.stage.stats(), prefixes.stats() if prefixes else None, self.engines.capped,
            dict(self.engines.one_at_a_time), dict(self.unused_media), dict(self.near_misses),
            dataclasses.replace(memory.stats, widths=dict(memory.stats.widths)) if memory else MemoryStats(),
        )  # fmt: skip

    def close(self) -> None:
        # Downloads in flight are abandoned, not awaited: Ctrl-C must not wait on a server.
        self.pool.shutdown(wait=False, cancel_futures=True)

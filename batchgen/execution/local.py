"""The local executor: jobs → media look-ahead → batched generation → results.

`LocalExecutor` is the loop a local run drives and each Ray actor runs on its share of the
rows (ray.py), so media overlap generation and rows are grouped over the window in both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..core.answers import answer_kinds
from ..core.errors import RowError, one_line, plural
from ..core.records import Finished, Job, Media, Result
from ..core.settings import WorkSettings
from ..generate.generator import Generated, Generator
from ..input.parse import near_miss, parse_job
from ..input.plan import Grouping
from ..input.read import RawRow, id_key
from ..media.resolve import Decoded, MediaStage, Prefetcher, Prepared
from ..output.pending import Pending
from .executor import Batches, Executor, ExecutorStats
from .planner import AsidePlanner

__all__ = ["LocalExecutor", "generate_window", "media_stage"]

FIRST_WINDOW_PATIENCE = 1.0  # seconds the first window waits for rows whose media are resolving

log = logging.getLogger(__name__)


def _result(job: Job, prepared: Prepared | None, outcome: Generated | RowError) -> Result:
    """One output row from a job, its media stage's times and files, and what generation made
    of it (or the error it failed with before)."""
    result = Result(id=job.id, input_hash=job.digest)
    constraint = job.params.constraint
    if constraint is not None and (kinds := answer_kinds(constraint)):  # failed rows too: the columns exist
        result.answer_kinds = json.dumps(kinds)
    if prepared is not None:
        t = prepared.times
        result.fetch_ms, result.decode_ms, result.frames_ms = t.fetch_ms, t.decode_ms, t.frames_ms
        result.media_files = [dataclasses.asdict(f) for f in prepared.files]
    error = outcome if isinstance(outcome, RowError) else outcome.error
    if isinstance(outcome, Generated):
        result.model, result.generate_ms = outcome.model, outcome.generate_ms
        result.adapter, result.adapter_sha256 = outcome.adapter, outcome.adapter_sha256
        result.choices, result.parsed, result.generation = outcome.choices, outcome.parsed, outcome.generation
    if error is not None:
        result.status, result.error, result.error_stage = "error", one_line(error.message), error.stage
        result.transient = error.transient
    return result


def media_stage(
    work: WorkSettings,
    tmp: Path,
    generator: Generator,
    stop: threading.Event | None = None,
    decoded: Decoded | None = None,
) -> MediaStage:
    """The media stage for a generator's rows: frames and pictures bounded as its model takes them."""
    info = generator.vision_info
    return MediaStage(work.media, work.base_dir, tmp, info.audio, info.max_pixels, stop, decoded)


def generate_window(
    window: list[tuple[Job, Prepared | None]], generator: Generator, planner: AsidePlanner | None = None
) -> Iterator[list[tuple[Job, Result]]]:
    """Results for a window of rows, a list at a time: the rows that failed before generation
    (reading, media, planning), then the generated rows as they finish. With a `planner`, the
    rows it planned aside are taken from it, and the next rows go to it while these run."""
    failed: list[tuple[Job, Result]] = []
    todo: list[int] = []  # the window's rows that go to the generator
    for w, (job, prepared) in enumerate(window):
        if job.error:
            failed.append((job, _result(job, prepared, RowError("read", job.error))))
        elif prepared is not None and prepared.error:
            failed.append((job, _result(job, prepared, prepared.error)))
        else:
            todo.append(w)

    def finished(g: Generated) -> tuple[Job, Result]:
        job, prepared = window[todo[g.index]]
        return job, _result(job, prepared, g)

    rows = [(job, p.media if p else Media()) for job, p in (window[w] for w in todo)]
    planned = planner.plan(window, todo, rows) if planner is not None else generator.plan(rows)
    failed += map(finished, planned.failed)
    if failed:
        yield failed
    for done in generator.run(planned):
        yield list(map(finished, done))


class LocalExecutor(Executor):
    """Raw rows in, results out, a list at a time: rows are parsed, their media resolve in
    worker threads up to a window ahead, and each window is generated in scheduled batches.
    A set `stop` ends the wait for media at once and generation between decode steps
    (StopRequested); the caller commits what came out before."""

    def _start(self) -> None:
        work, stop = self.work, self.stop
        self.generator = self.make_generator(work.generation, stop)  # the models inspected, none loaded
        self.generator.load_drafter()  # a drafter that cannot pair with its target stops the run here
        self.stage = media_stage(work, self.tmp_dir, self.generator, stop, self.decoded)
        self.pool = ThreadPoolExecutor(work.media.fetch_workers, thread_name_prefix="batchgen-media")
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
            log.warning(
                "%s: body.model %r is not used: the rows run on %s",
                job.where,
                job.asked_model[:80],
                self.generator.model_for(job),
            )
        for name in job.near_misses:
            if name not in self.near_misses:  # the first row with it: said at once, counted at the end
                log.warning(
                    "%s: field %r is not one batchgen reads; did you mean %r? (kept as data)",
                    job.where,
                    name,
                    near_miss(name),
                )
            self.near_misses[name] = self.near_misses.get(name, 0) + 1
        return job

    def run(self, todo: Pending) -> Batches:
        self.looped = todo.looped
        rows = todo.rows()
        if self.config.plan_horizon:  # rows sharing a picture or prefix brought together over the job
            grouping = Grouping(todo.index, todo.done)
            f = grouping.figures
            log.info(
                "plan: %s to do, %s in %s sharing a picture or prefix (largest %s), %s alone",
                plural(f.rows, "row"),
                f"{f.grouped:,}",
                plural(f.groups, "group"),
                f"{f.largest:,}",
                f"{f.alone:,}",
            )
            rows = grouping.ordered(rows, self.config.plan_horizon * 2**20, self.work.window)
        return self.generate(rows)

    def generate(self, rows: Iterable[RawRow]) -> Batches:
        """Finished rows for these raw rows (a Ray actor's share, or the pending rows here)."""
        c = self.work
        parsed = (parse_job(raw, c) for raw in rows)
        jobs = (self._counted(self._redone(job)) for job in parsed)
        prefetcher = Prefetcher(jobs, self.stage, self.pool, c.window, stop=self.stop)
        prefetcher.start()
        # Load the models the first rows need while their media download.
        queued = [job for job, _ in prefetcher.ahead if not job.error]
        self.generator.load(vision=any(j.media for j in queued), text=any(not j.media for j in queued))
        # The first window starts with a quarter of a batch, after waiting a moment for more
        # (local files decode in it; a slow network does not hold generation back for long):
        # rows split over windows would decode in narrower batches.
        batch_size = c.generation.batch_size
        least, patience = max(1, batch_size // 4), FIRST_WINDOW_PATIENCE
        planner = AsidePlanner(self.generator, prefetcher, self.stop) if c.plan_aside else None
        if planner is not None:
            planner.offer()  # the first rows planned as their media resolve
        try:
            while not self.stop.is_set() and (window := prefetcher.take(c.window, least, patience)):
                if self.stop.is_set():  # a download the stop cut short fails no row: the rows run again
                    return
                least, patience = batch_size, 0.0
                log.debug(
                    "window: %d rows (%d with media, %d failed before generation)",
                    len(window),
                    sum(bool(job.media) for job, _ in window),
                    sum(bool(job.error or (p is not None and p.error)) for job, p in window),
                )
                for done in generate_window(window, self.generator, planner):
                    yield [Finished(values=job.raw, where=job.where, result=r) for job, r in done]
        finally:
            if planner is not None:
                planner.close()
                log.debug("planned aside: %d rows", self.generator.stats().planned_aside)

    def stats(self) -> ExecutorStats:
        return ExecutorStats(
            media=self.stage.stats(),
            generation=self.generator.stats(),
            unused_media=dict(self.unused_media),
            near_misses=dict(self.near_misses),
        )

    def close(self) -> None:
        # Downloads in flight are abandoned, not awaited: Ctrl-C must not wait on a server.
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.generator.close()

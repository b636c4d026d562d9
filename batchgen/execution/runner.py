"""The runner: read → media → generate → write and the run's figures; the caller owns the process."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import (
    BatchgenError,
    ConfigError,
    FailFastError,
    Interrupted,
    JobFileError,
    RunFailedError,
    StopRequested,
    one_line,
    short,
)
from ..core.figures import CacheStats
from ..core.records import TOTALS, Finished
from ..core.settings import RunConfig, work_settings
from ..core.stop import Stop
from ..generate.generator import Generator, GeneratorFactory
from ..input.read import JobIndex
from ..media.resolve import Decoded
from ..output.resume import Resume
from ..output.run_files import Heartbeat, OutputLock, errors_owned, errors_path, heartbeat_path, write_errors
from ..output.stats import stats_path, write_stats
from ..output.write import ResultWriter
from .executor import Executor
from .passes import executor_for
from .start import open_job, resume_of, writer_for
from .summary import TRACE, Progress, RunSummary, finish

__all__ = ["run", "record_row"]

log = logging.getLogger(__name__)


def record_row(done: Finished, writer: ResultWriter, summary: RunSummary, config: RunConfig) -> None:
    """One finished row to the writer and the running figures (--fail-fast stops here)."""
    result = done.result
    if result.status == "error" and config.fail_fast:
        writer.flush()
        raise FailFastError(
            f"{done.where}: {result.error_stage}: {result.error} (--fail-fast; "
            f"finished rows kept in {writer.partial}, rerun to resume)"
        )
    writer.add(done.values, result)
    gen = result.generation
    if log.isEnabledFor(TRACE):
        what = (
            f"{gen.completion_tokens} tokens, {gen.finish_reason}"
            if result.status == "ok" and gen is not None
            else (f"{result.error_stage}: {result.error}")
        )
        log.log(TRACE, "row %s: %s, %s (%.0f ms)", done.where, result.status, what, result.generate_ms)
    summary.generated += 1
    summary.failed += result.status == "error"  # running count for the bar; _finish recounts
    summary.failed_now += result.status == "error"
    if gen is not None:
        summary.repetitions += gen.finish_reason == "repetition"
        for name in TOTALS:
            setattr(summary, name, getattr(summary, name) + getattr(gen, name))


def run(
    config: RunConfig,
    progress: Callable[[Progress], None] | None = None,
    stop: threading.Event | None = None,
    generator: GeneratorFactory | None = None,
    decoded: Decoded | None = None,
) -> RunSummary:
    """Run a job file to completion; rows already in the output or its parts are skipped.

    The job file and the models are checked before the output is locked or touched. The run
    prints nothing and installs no signal handler: `progress` is called with a `Progress` when
    it starts and after every batch it commits; a set `stop` ends it between two batches
    (finished rows written, then Interrupted), and a `core.stop.Stop` also learns what a hard
    exit must clean. `config.time_limit` ends it early as an incomplete run, not an error.
    `generator` and `decoded` are what a caller running several runs keeps between them: the
    models (`generate.generator.Resident`) and the decoded media (`media.resolve.Decoded`).

    Returns the RunSummary (its `exit_code(fail_on, require_complete)` is the CLI's: 0, 1 for
    failed rows, 4 for an incomplete run that had to complete). Raises, each with the
    `exit_code` the CLI exits with: ConfigError, JobFileError and OutputLockedError (2: bad
    settings, an unreadable job, duplicate ids, an output held by another run, a model that
    cannot load — before any row was committed), RunFailedError (6: the same after rows were
    committed, or a failed Ray run), FailFastError (1, `fail_fast`), Interrupted (130; the CLI
    says 143 after SIGTERM). Any other exception is a bug (the CLI exits 3); finished rows are
    kept in every case, and a rerun resumes."""
    if config.stages:
        raise ConfigError("a staged job runs through batchgen.run (execution.stages), a stage at a time")
    started = time.perf_counter()
    stop = stop if stop is not None else Stop()
    index = open_job(config)
    work = work_settings(config, index.base)
    # What a hard exit must clean: a Stop's caller runs them; a plain Event's cannot, and the
    # run's own `with` blocks clean up on every way out but os._exit.
    cleanups: list[Callable[[], None]] = stop.cleanups if isinstance(stop, Stop) else []
    held = len(cleanups)  # the caller's own, kept when this run's go
    with tempfile.TemporaryDirectory(prefix="batchgen-", ignore_cleanup_errors=True) as tmp:
        cleanups.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
        try:  # the models are inspected here, before the output is touched
            executor = executor_for(config)(config, work, Path(tmp), stop, generator or Generator, decoded)
            try:
                with OutputLock(config.output) as lock:
                    cleanups.append(lambda: lock.path.unlink(missing_ok=True))
                    return _run(config, index, executor, _Caller(progress, stop), started)
            finally:
                executor.close()
        finally:
            del cleanups[held:]


@dataclass(slots=True)
class _Caller:
    """The caller's side of a run: its progress callback and its stop request; `time_up` when
    --time-limit set the stop (the run then ends as an incomplete one, not Interrupted)."""

    progress: Callable[[Progress], None] | None
    stop: threading.Event
    time_up: threading.Event = dataclasses.field(default_factory=threading.Event)

    def tell(self, report: Progress) -> None:
        if self.progress is not None:
            self.progress(report)

    def check(self, writer: ResultWriter) -> None:
        if self.stop.is_set() and not self.time_up.is_set():
            writer.flush()
            raise Interrupted(f"finished rows are kept in {writer.partial}, rerun to resume")


class _Clock:
    """--time-limit: no batch is taken whose expected length (the longest of the last three
    commits' spacing) would end it past the limit; a batch still running at the limit is
    stopped between decode steps (its rows run again on resume)."""

    def __init__(self, limit: float | None, started: float, caller: _Caller):
        self.limit, self.started, self.caller = limit, started, caller
        self.spans: list[float] = []
        self.last = started
        self.timer: threading.Timer | None = None
        if limit is not None:
            self.timer = threading.Timer(max(started + limit - time.perf_counter(), 0), self._up)
            self.timer.daemon = True
            self.timer.start()

    def _up(self) -> None:
        self.caller.time_up.set()
        self.caller.stop.set()

    def committed(self) -> bool:
        """After a commit: whether the next batch may start."""
        now = time.perf_counter()
        self.spans = [*self.spans[-2:], now - self.last]
        self.last = now
        if self.limit is None or self.caller.time_up.is_set():
            return not self.caller.time_up.is_set()
        if now + max(self.spans) > self.started + self.limit:
            self.caller.time_up.set()
            return False
        return True

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _run(
    config: RunConfig, index: JobIndex, executor: Executor, caller: _Caller, started: float
) -> RunSummary:
    writer = writer_for(config, index)
    resume = resume_of(config, index, writer, writer.open())
    writer.expect(resume.pending)
    todo = resume.todo
    summary = RunSummary(
        output=str(config.output),
        job_rows=len(index.output_ids),
        dropped_columns=sorted(writer.skip),
        private_urls_allowed=config.media.allow_private_urls,
        looped_again=len(resume.pending.looped),
    )

    def report(rows: int, cache: CacheStats | None) -> Progress:
        elapsed = time.perf_counter() - started
        return Progress(
            summary, todo, resume.done_before, len(resume.retry), resume.redone, rows, cache, elapsed
        )

    beat = Heartbeat.begin(todo, resume.done_before, config.time_limit)
    with _heartbeat(beat, writer, heartbeat_path(config.output, config.output_shards), summary) as tick:
        caller.tell(report(0, None))
        clock = _Clock(config.time_limit, started, caller)
        this_run = _generate(config, executor, caller, resume, writer, summary, report, tick, clock)
        _conclude(config, writer, summary, started, this_run)
        beat.end("complete" if summary.complete else "time-limit" if summary.time_limited else "incomplete")
    return summary


def _generate(
    config: RunConfig,
    executor: Executor,
    caller: _Caller,
    resume: Resume,
    writer: ResultWriter,
    summary: RunSummary,
    report: Callable[[int, CacheStats | None], Progress],
    tick: Callable[[float], None],
    clock: _Clock,
) -> set:
    """The pending rows through the executor, committed batch by batch until done, stopped or
    out of time; the executor's figures into `summary`. Returns the ids this run failed."""
    this_run: set = set()  # apart from earlier runs' failures
    batches = executor.run(resume.pending)
    try:
        try:
            for finished in batches:
                for done in finished:
                    done.result.attempts = resume.attempts(done.result.id)
                    if done.result.status == "error":
                        this_run.add(done.result.id)
                    record_row(done, writer, summary, config)
                writer.flush()  # a finished batch is on disk before the next one starts
                progress = report(len(finished), executor.stats().generation.cache)
                tick(progress.elapsed)
                caller.tell(progress)
                caller.check(writer)
                if not clock.committed():
                    break
        except StopRequested:
            pass  # the batch in flight is dropped; its rows run again on resume
        except (ConfigError, JobFileError) as e:  # a model that cannot load, a job file replaced
            writer.flush()
            if not summary.generated:  # nothing committed: as before any work
                raise
            kept = f"finished rows are kept in {writer.partial}, rerun to resume"
            raise RunFailedError(f"{e}; {kept}") from None
        caller.check(writer)
    finally:
        clock.close()
        batches.close()
    summary.work = executor.stats()
    summary.time_limited = caller.time_up.is_set()
    return this_run


@contextmanager
def _heartbeat(
    beat: Heartbeat, writer: ResultWriter, path: str, summary: RunSummary
) -> Iterator[Callable[[float], None]]:
    """The heartbeat kept while the run goes: written now, after every commit (the callable
    it gives, with the seconds elapsed), and with how the run ended, an exception's too."""

    def tick(elapsed: float) -> None:
        beat.committed(summary.generated, summary.failed_now, elapsed)
        _beat(beat, writer, path)

    try:
        _beat(beat, writer, path)
        yield tick
    except Interrupted as e:
        beat.end("interrupted", str(e))
        raise
    except BatchgenError as e:
        beat.end("failed", str(e))
        raise
    except Exception as e:
        beat.end("crashed", f"{type(e).__name__}: {short(e)}")
        raise
    finally:
        _beat(beat, writer, path)


def _beat(beat: Heartbeat, writer: ResultWriter, path: str) -> None:
    """The heartbeat on disk; one that cannot be written costs the watchers, not the run."""
    try:
        beat.write(writer.store, path)
    except OSError as e:
        log.warning("warning: cannot write the heartbeat %s (%s)", path, e.strerror or e)


def _conclude(
    config: RunConfig, writer: ResultWriter, summary: RunSummary, started: float, this_run: set
) -> RunSummary:
    """The output renamed into place (and its sinks written), the failed rows' file, the
    figures on disk."""
    table = writer.finalize()
    finish(summary, table, len(writer.index.output_ids), time.perf_counter() - started)
    path = str(stats_path(config.output, config.output_shards))
    errors = str(config.errors_file or errors_path(config.output, config.output_shards))
    if errors_owned(errors, config.output, config.output_shards, path):
        summary.errors_sha256 = write_errors(writer.store, errors, table, this_run)
    else:  # checked before the run: a file put there since is left alone
        log.warning(
            "warning: %s appeared during the run and is not batchgen's: no error file written",
            one_line(errors),
        )
    summary.errors_file = errors if summary.errors_sha256 else None
    write_stats(writer.store, path, summary.figures())
    return summary

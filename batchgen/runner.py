"""The runner: wires read → media → generate → write, owns progress, stats and exit codes."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from .config import RunConfig
from .engine import Engines
from .errors import FailFastError, RowError
from .media import MediaStage, Prepared
from .parse import parse_row
from .read import JobIndex, id_key, iter_rows, scan
from .records import Job, Result
from .write import ResultWriter, _atomic_write

__all__ = ["RunSummary", "run", "process_row"]


@dataclass(slots=True)
class RunSummary:
    """The figures printed at the end and saved as `<output>.stats.json`."""

    output: str
    rows: int = 0
    ok: int = 0
    failed: int = 0
    resumed: int = 0  # rows taken from an earlier run instead of generated again
    generated: int = 0  # rows processed by this run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0  # completion tokens of this run's rows per second of wall time
    errors_by_stage: dict[str, int] = field(default_factory=dict)
    media: dict[str, int] = field(default_factory=dict)  # downloads, reuses, decodes (MediaStage.stats)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def line(self) -> str:
        return (
            f"{self.rows} rows: {self.ok} ok, {self.failed} failed ({self.resumed} resumed) · "
            f"tokens {self.prompt_tokens} prompt / {self.completion_tokens} completion · "
            f"{self.wall_s:.1f} s, {self.rows_per_s:.2f} rows/s, {self.tokens_per_s:.1f} tok/s"
        )


def process_row(job: Job, prepared: Prepared | None, engines: Engines) -> Result:
    """One row's generation, given its resolved media; any failure becomes the row's error."""
    result = Result(id=job.id)
    if job.error:
        result.status, result.error, result.error_stage = "error", job.error, "read"
        return result
    prepared = prepared or Prepared()
    t = prepared.times
    result.fetch_ms, result.decode_ms, result.frames_ms = t.fetch_ms, t.decode_ms, t.frames_ms
    t0 = time.perf_counter()
    try:
        if prepared.error:
            raise prepared.error
        result.model = engines.model_for(job)
        gen = engines.generate(job, prepared.media)
        result.generated_text, result.finish_reason = gen.text, gen.finish_reason
        result.prompt_tokens, result.completion_tokens = gen.prompt_tokens, gen.completion_tokens
        result.cached_tokens = gen.cached_tokens
        result.mtp_drafts, result.mtp_accepted = gen.mtp_drafts, gen.mtp_accepted
        result.generate_ms = (time.perf_counter() - t0) * 1000
    except RowError as e:
        result.status, result.error, result.error_stage = "error", e.message, e.stage
        if e.stage == "generate":
            result.generate_ms = (time.perf_counter() - t0) * 1000
    return result


def _finish(s: RunSummary, table: pa.Table, wall: float) -> RunSummary:
    """Row counts come from the final table, token counts from this run's rows."""
    s.rows = table.num_rows
    statuses = table.column("status").to_pylist()
    s.ok = statuses.count("ok")
    s.failed = len(statuses) - s.ok
    s.resumed = table.num_rows - s.generated
    for stage in table.column("error_stage").to_pylist():
        if stage:
            s.errors_by_stage[stage] = s.errors_by_stage.get(stage, 0) + 1
    s.wall_s = round(wall, 3)
    s.rows_per_s = round(s.generated / wall, 3) if wall > 0 else 0.0
    s.tokens_per_s = round(s.completion_tokens / wall, 1) if wall > 0 else 0.0
    return s


def _todo(config: RunConfig, index: JobIndex, done: dict[str, str]) -> Iterator[Job]:
    for raw in iter_rows(config.input, index.format):
        if raw.index >= len(index):
            return
        if id_key(raw.id) not in done:
            yield parse_row(raw, config.defaults)[0]


def _prefetched(jobs: Iterator[Job], stage: MediaStage, pool: ThreadPoolExecutor, depth: int):
    """Jobs in order with their media resolving `depth` rows ahead, so I/O hides behind
    generation while at most `depth` rows of media sit in memory."""
    window: deque[tuple[Job, Future | None]] = deque()
    for job in jobs:
        needs_media = job.media and not job.error
        window.append((job, pool.submit(stage.resolve, job) if needs_media else None))
        if len(window) >= depth:
            head, future = window.popleft()
            yield head, future.result() if future else None
    while window:
        head, future = window.popleft()
        yield head, future.result() if future else None


def run(config: RunConfig) -> RunSummary:
    """Run a job file to completion; rows already in the output or its parts are skipped."""
    started = time.perf_counter()
    index = scan(config.input, config.format)
    if config.limit is not None:
        index.ids = index.ids[: config.limit]
    engines = Engines(config.model, config.text_model)
    manifest = {"input": str(config.input), "model": config.model, "text_model": config.text_model}
    writer = ResultWriter(
        config.output, index, manifest, config.overwrite, config.flush_rows, config.flush_seconds
    )
    done = writer.done()
    todo = sum(id_key(i) not in done for i in index.ids)
    summary = RunSummary(output=str(config.output))
    bar = tqdm(total=todo, unit="row", file=sys.stderr, disable=config.quiet or None, dynamic_ncols=True)
    with bar, tempfile.TemporaryDirectory(prefix="batchgen-", ignore_cleanup_errors=True) as tmp:
        stage = MediaStage(
            config.media, config.input.parent, Path(tmp), audio_from_video=engines.vision_info.audio
        )
        pool = ThreadPoolExecutor(config.media.fetch_workers, thread_name_prefix="batchgen-media")
        try:
            for job, prepared in _prefetched(
                _todo(config, index, done), stage, pool, config.media.prefetch_rows
            ):
                result = process_row(job, prepared, engines)
                if result.status == "error" and config.fail_fast:
                    writer.flush()
                    raise FailFastError(
                        f"{job.where}: {result.error_stage}: {result.error} (--fail-fast; "
                        f"finished rows kept in {writer.partial}, rerun to resume)"
                    )
                writer.add(job.raw, result)
                summary.generated += 1
                summary.prompt_tokens += result.prompt_tokens
                summary.completion_tokens += result.completion_tokens
                summary.cached_tokens += result.cached_tokens
                bar.update()
                elapsed = time.perf_counter() - started
                bar.set_postfix_str(f"{summary.completion_tokens / elapsed:.0f} tok/s", refresh=False)
        finally:
            # Downloads in flight are abandoned, not awaited: Ctrl-C must not wait on a server.
            pool.shutdown(wait=False, cancel_futures=True)
        table = writer.finalize()
        summary.media = stage.stats()
    _finish(summary, table, time.perf_counter() - started)
    stats_path = config.output.with_name(config.output.name + ".stats.json")
    _atomic_write(stats_path, lambda p: p.write_text(json.dumps(asdict(summary), indent=2) + "\n"))
    return summary

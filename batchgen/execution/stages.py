"""A staged job: each stage a run over the rows the stage before kept, then one output.

A stage's prompt is filled from the job's columns and the earlier stages' values by their dotted
names (`{caption.generated_text}`, `{score.choice_scores.yes}`).

Each stage runs through `runner.run` into `OUT.stages/NN-NAME.parquet`, so it resumes as any
run does: a kill during stage 2 leaves stage 1 whole, and the rerun finds stage 1 done and goes
on with stage 2's rows not done. The job a later stage reads (`NN-NAME.job.parquet`) is made
from the stages before it each time: the kept rows with the job's columns and every earlier
stage's values. A stage whose settings changed since its last run is run again from scratch, and
so is every stage after it; the stages before it are kept. The models stay loaded from stage to
stage while they are the same (`Resident`), and so do the decoded pictures (`Decoded`): a later
stage's picture rows find the picture decoded and its prefix in the prefix cache while the
caches still hold them (every other stage reads its rows backwards, so it starts with the
pictures the stage before ended with). A job past the caches' bounds (512 MB of decoded
pixels, the prefix cache's entries) decodes and prefills the pictures it no longer holds again.

The output: a row per job row, the job's columns, then each stage's columns under its name
(`caption.generated_text`, `score.choice_scores`, …), and `dropped_at`, the stage whose keep_if
a row did not meet or that failed it (null for rows that went through every stage). When no row
goes on, the stages left do not run and have no columns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError, plural
from ..core.keep import KeepIf
from ..core.records import TOTALS
from ..core.settings import RunConfig, Stage
from ..generate.generator import GeneratorFactory, Resident
from ..media.resolve import Decoded
from ..output.about import About, Standing
from ..output.resume import settings_of
from ..output.run_files import stage_output, stages_folder
from ..output.stats import stats_path, write_stats
from ..output.store import Store, atomic_write
from ..output.tables import is_ours
from . import runner
from .executor import ExecutorStats
from .start import open_job
from .summary import Progress, RunSummary, finish

__all__ = ["run", "run_stages", "stage_values"]

log = logging.getLogger(__name__)


def run(
    config: RunConfig,
    progress: Callable[[Progress], None] | None = None,
    stop: threading.Event | None = None,
    generator: GeneratorFactory | None = None,
) -> RunSummary:
    """A job's run (`batchgen.run`): its stages one after another when it has them, else the
    one run `runner.run` makes."""
    if config.stages:
        return run_stages(config, progress, stop, generator)
    return runner.run(config, progress, stop, generator)


def run_stages(
    config: RunConfig,
    progress: Callable[[Progress], None] | None = None,
    stop: threading.Event | None = None,
    generator: GeneratorFactory | None = None,
) -> RunSummary:
    """Every stage in turn, then the joined output at `config.output` and its stats file. The
    summary counts the job's rows from its output and adds up every stage's tokens and media
    work; a --time-limit is the whole job's, each stage getting what the stages before left
    (the job is then incomplete, a rerun goes on)."""
    if isinstance(config.output, str) or isinstance(config.input, str) or config.output_shards:
        raise ConfigError("a staged job reads a local job file and writes one local Parquet file")
    if any(stage.config.executor != "local" for stage in config.stages):
        raise ConfigError("a staged job runs on the local engine")
    started = time.monotonic()
    index = open_job(dataclasses.replace(config.stages[0].config, input=config.input, output=config.output))
    rules = _rules(config, set(index.columns))
    stages_folder(config.output).mkdir(parents=True, exist_ok=True)
    resident = Resident()  # the models kept from stage to stage (unless the caller makes them)
    models: GeneratorFactory = generator if generator is not None else resident
    decoded = Decoded()  # and the pictures: each decoded once for every stage (within its bounds)
    table: pa.Table | None = None  # the job's rows so far: its columns and the stages' values
    dropped: dict[Any, str] = {}
    summaries: list[RunSummary] = []
    redo, timed_out = config.overwrite, False  # --overwrite: every stage afresh
    try:
        for number, stage in enumerate(config.stages, 1):
            if table is not None and len(dropped) == table.num_rows:
                break  # every row stopped before this stage: the stages left have nothing to do
            left = None if config.time_limit is None else config.time_limit - (time.monotonic() - started)
            if left is not None and left <= 0 and table is not None:  # the first stage always starts
                timed_out = True
                break
            left = None if left is None else max(left, 1.0)
            _say_stage(
                config.stages, number, len(index.output) if table is None else table.num_rows - len(dropped)
            )
            base = stage_output(config.output, number, stage.name).with_suffix("")
            stage_config = _stage_config(stage, number, base, table, dropped, index.base, left)
            redo = _settled(stage, stage_config, base.with_suffix(".settings.json"), redo)
            stage_config = dataclasses.replace(stage_config, overwrite=redo)
            summary = runner.run(stage_config, progress, stop, models, decoded)
            summaries.append(summary)
            table = _joined(table, pq.read_table(stage_config.output), stage.name, dropped)
            _dropped(table, stage.name, rules.get(stage.name), dropped)
            if not summary.complete:
                break
    finally:
        resident.close()
    assert table is not None
    table = _finished(table, dropped, config.stages[-1].name)
    summary = _summed(summaries, str(config.output), table, len(index.output), time.monotonic() - started)
    summary.time_limited = summary.time_limited or timed_out
    _write(Path(config.output), table, summary)
    return summary


def _write(output: Path, table: pa.Table, summary: RunSummary) -> None:
    """The job's output and its stats file. Where the output stands, in its metadata, is the
    job's, not its first stage's (whose other metadata it carries)."""
    standing = Standing(complete=summary.complete, job_rows=summary.job_rows, pending=summary.pending)
    meta = {**(table.schema.metadata or {}), **About(standing=standing).metadata()}
    atomic_write(output, lambda p: pq.write_table(table.replace_schema_metadata(meta), p))
    path = str(stats_path(output))
    write_stats(Store(path), path, summary.figures())


def _say_stage(stages: tuple[Stage, ...], number: int, rows: int) -> None:
    """The log's line as a stage starts, and why it cannot reuse the stage before's prefixes
    when it runs on another model."""
    stage = stages[number - 1]
    log.info("stage %d of %d, %s: %s", number, len(stages), stage.name, plural(rows, "row"))
    before = stages[number - 2] if number > 1 else None
    if before is not None and before.config.model != stage.config.model:
        log.info(
            "stage %s runs on %s, stage %s on %s: the pictures' prefixes cannot be shared between "
            "them (their decoded pictures are)",
            stage.name,
            Path(stage.config.model).name,
            before.name,
            Path(before.config.model).name,
        )


def _stage_config(
    stage: Stage,
    number: int,
    base: Path,
    table: pa.Table | None,
    dropped: dict[Any, str],
    paths_from: str | None,
    left: float | None,
) -> RunConfig:
    """A stage's run: the job itself for the first stage; for a later one, the rows still
    going (made into `base.job.parquet`), their relative paths from the job's folder, and a
    row the stages before answered differently redone."""
    own = stage.config
    more: dict[str, Any] = {"time_limit": left} if left is not None else {}
    if table is not None:
        job = _stage_job(table, dropped, base.with_suffix(".job.parquet"), backwards=number % 2 == 0)
        columns = dataclasses.replace(own.columns, id=None)
        more |= {"input": job, "changed": "redo", "paths_from": paths_from, "columns": columns}
    return dataclasses.replace(own, output=base.with_suffix(".parquet"), stages=(), **more)


def _summed(
    summaries: list[RunSummary], output: str, table: pa.Table, job_rows: int, wall: float
) -> RunSummary:
    """The job's summary: its rows counted from its output as a run's are (ok, failed by
    `stage.error_stage`, pending), every stage's tokens and media work added up, the last
    stage's other figures. Its failed rows are the output's (`inspect --failed` lists them); each
    stage's error file names its own."""
    summary = dataclasses.replace(
        summaries[-1], output=output, errors_by_stage={}, groups={}, errors_file=None, errors_sha256=None
    )
    for name in _ADDED:
        setattr(summary, name, sum(getattr(s, name) for s in summaries))
    # Every stage's work added up; the warnings about the job's columns are the first stage's.
    first = summaries[0].work
    summary.work = dataclasses.replace(
        ExecutorStats.added([s.work for s in summaries]),
        unused_media=first.unused_media,
        near_misses=first.near_misses,
    )
    summary.time_limited = any(s.time_limited for s in summaries)
    summary.failed_now = sum(s.failed_now for s in summaries)
    finish(summary, table, job_rows, wall)
    summary.resumed = sum(s.resumed for s in summaries)
    return summary


_ADDED = ("generated", *TOTALS, "repetitions")  # every stage's rows, tokens and loops, added up


def _finished(table: pa.Table, dropped: dict[Any, str], last: str) -> pa.Table:
    """The rows done with: those that went through every stage (`last` answered them) and those
    that stopped at one (`dropped_at`), each with the job's `status`: `error` when a stage failed
    the row, `error` and `error_stage` then that stage's (`stage.error_stage`). The rows still
    going wait in the stages' files for a rerun, as a run's pending rows do."""
    rows = table.to_pylist()
    done = [r["id"] in dropped or r.get(f"{last}.status") is not None for r in rows]
    table = table.filter(pa.array(done, pa.bool_()))
    rows = [r for r, d in zip(rows, done, strict=True) if d]
    at = [dropped.get(r["id"], last) for r in rows]  # the stage each row ended at
    failed = [name if r.get(f"{name}.status") == "error" else None for r, name in zip(rows, at, strict=True)]
    ended = list(zip(rows, failed, strict=True))
    columns = {
        "status": ["error" if f else "ok" for f in failed],
        "error": [r.get(f"{f}.error") if f else None for r, f in ended],
        "error_stage": [f"{f}.{r.get(f'{f}.error_stage')}" if f else None for r, f in ended],
        "dropped_at": [dropped.get(r["id"]) for r in rows],
    }
    for name, values in columns.items():
        table = table.append_column(name, pa.array(values, pa.string()))
    return table


def _settled(stage: Stage, config: RunConfig, path: Path, redo: bool) -> bool:
    """Whether the stage runs again from scratch: a stage before it did, or its settings
    changed since its output was made (recorded beside it)."""
    now = {
        "settings": settings_of(config),
        "prompt_template": config.prompt_template,
        "keep_if": stage.keep_if,
    }
    now = json.loads(json.dumps(now, default=str))
    before = json.loads(path.read_text()) if path.exists() else None
    changed = before is not None and before != now
    atomic_write(path, lambda p: p.write_text(json.dumps(now, indent=2) + "\n"))
    return redo or changed


def _joined(table: pa.Table | None, out: pa.Table, name: str, dropped: dict[Any, str]) -> pa.Table:
    """The rows so far with a stage's values (`name.column`), by id; rows the stage did not run
    (dropped before it) get nulls, whatever its output holds for them from an earlier run."""
    results = [n for n in out.column_names if is_ours(n)]
    if table is None:  # the first stage: the job's own columns, then the stage's
        own = out.select([c for c in out.column_names if c not in results])
    else:
        own = table
    at = {row_id: i for i, row_id in enumerate(out.column("id").to_pylist())}
    ids = own.column("id").to_pylist()
    take = pa.array([None if row_id in dropped else at.get(row_id) for row_id in ids], pa.int64())
    for column in results:
        own = own.append_column(f"{name}.{column}", out.column(column).take(take))
    return own


def stage_values(row: dict[str, Any]) -> dict[str, Any]:
    """A row's values as templates and keep_if read them: each column by its name, a score's
    choices one by one (`score.choice_scores.yes`: that choice's probability), and each stage's
    own value by its bare name: a scoring stage's first choice's probability (`score > 0.5`),
    else its answer (`{caption}`)."""
    values = dict(row)
    for name, value in row.items():
        if name.endswith(".choice_scores") and isinstance(value, list):
            for scored in value:
                if isinstance(scored, dict) and isinstance(scored.get("choice"), str):
                    values[f"{name}.{scored['choice']}"] = scored.get("prob")
    for name in [
        n[: -len(".status")] for n in row if n.endswith(".status") and "." not in n[: -len(".status")]
    ]:
        scored = row.get(f"{name}.choice_scores")
        first = scored[0] if isinstance(scored, list) and scored and isinstance(scored[0], dict) else None
        values[name] = first.get("prob") if first is not None else row.get(f"{name}.generated_text")
    return values


def _rules(config: RunConfig, columns: set[str]) -> dict[str, KeepIf]:
    """Each stage's keep_if, its names checked before any work: a job column, or a stage's
    value up to and including its own. A stage named like a job column would hide it."""
    clash = sorted(stage.name for stage in config.stages if stage.name in columns)
    if clash:
        raise ConfigError(f"stage(s) {', '.join(clash)} named like a column of the job: name them otherwise")
    if "dropped_at" in columns:
        raise ConfigError("the job has a column 'dropped_at', which a staged job's output writes: rename it")
    rules: dict[str, KeepIf] = {}
    for number, stage in enumerate(config.stages):
        if stage.keep_if is not None:
            known = columns | {s.name for s in config.stages[: number + 1]}
            rules[stage.name] = KeepIf.parse(stage.keep_if, known, where=f"stage {stage.name}: keep_if")
    return rules


def _dropped(table: pa.Table, name: str, rule: KeepIf | None, dropped: dict[Any, str]) -> None:
    """The rows the stage answered that meet its keep_if go on; the others stop here
    (`dropped_at`): a row the stage failed, or one its rule does not keep. A row the stage has
    not answered yet (a --limit, a --time-limit, a kill) stops nowhere: it is still to do."""
    for row in table.to_pylist():
        status = row.get(f"{name}.status")
        if row["id"] in dropped or status is None:
            continue
        if status != "ok" or (rule is not None and not rule.keeps(stage_values(row))):
            dropped[row["id"]] = name


def _stage_job(table: pa.Table, dropped: dict[Any, str], path: Path, backwards: bool) -> Path:
    """The job a later stage reads: the rows still going, each with the job's columns and the
    earlier stages' values (a score's choices as their own columns, for templates). Every
    other stage reads them backwards: it starts with the pictures the stage before ended with,
    whose prefixes and vision features the caches still hold (they keep the latest few dozen)."""
    rows = [stage_values(r) for r in table.to_pylist() if r["id"] not in dropped]
    if backwards:
        rows.reverse()
    made = pa.Table.from_pylist(rows)
    atomic_write(path, lambda p: pq.write_table(made, p))
    return path

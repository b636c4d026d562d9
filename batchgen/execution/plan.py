"""`batchgen plan` (and `run --dry-run`): what a run will do and cost, said before it starts.

Its rows, what they share, the prompt tokens the model will see and the lanes rows go to, from
the same scan, resume, plan order, parse, media stage and lanes as the run, with the weights
mapped but never read. With `calibrate`, that many rows are really generated (in plan order,
into no output) and the run's wall time is projected from them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from ..core.records import Job, Media
from ..core.settings import BASE_ADAPTER, RunConfig, WorkSettings, work_settings
from ..generate.generator import Generator
from ..generate.router import Plan
from ..input.parse import parse_job
from ..input.plan import Grouping
from ..input.read import RawRow
from ..media.resolve import MediaStage
from .local import generate_window, media_stage
from .start import open_job, resume_of, writer_for

__all__ = ["PlanReport", "Calibration", "plan_job"]


@dataclass(slots=True)
class Calibration:
    """Rows really run to time the job. The first half pays what a run pays once (a shared
    system prompt's prefill, the first compiles) on top of the rate. The second half is timed
    in two passes, since a few rows decode narrower than a run does (a decode step costs a
    fixed part plus a part per row, so a narrow batch pays more per row): its prefill alone
    (max_tokens 1), then its decoding at the run's batch width (each row as copies of itself,
    their prefixes now cached)."""

    rows: int
    load_s: float  # loading the models, once per run
    once_s: float  # what the first half took beyond the rate: paid once per run
    prefill_s: float  # a row's prefill (its media and planning included)
    decode_s: float  # a row's decoding, at the run's batch width
    projected_s: float  # the whole run: its scan, the load, the once-paid part, every row at the rate

    @property
    def row_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(slots=True)
class PlanReport:
    """What a run of the job would do, before it starts."""

    job_rows: int  # rows of the job (its --shard's)
    todo: int  # ... not done yet (resume): the rows a run would generate
    done_before: int
    grouped: int  # rows to do that share a picture or a long prefix with another
    groups: int
    pictures: int  # distinct image references among the rows to do
    clips: int  # ... video references
    media_rows: int  # rows to do with media
    prompt_tokens: int  # the rows' prompts as the model sees them (media slots expanded)
    media_tokens: int  # ... of which image and video tokens
    reused_tokens: int  # prefill the prefix cache would serve, in plan order (an estimate)
    lanes: dict[str, int] = field(default_factory=dict)  # rows per lane
    models: dict[str, int] = field(default_factory=dict)  # rows per model of --models (by name)
    adapters: dict[str, int] = field(default_factory=dict)  # rows per adapter (by name), where rows name any
    one_at_a_time: dict[str, int] = field(default_factory=dict)  # why rows cannot batch
    failing: dict[str, int] = field(default_factory=dict)  # rows that fail before generating, by stage
    plan_s: float = 0.0  # scanning, reading and tokenizing the job
    calibration: Calibration | None = None

    @property
    def rows_per_picture(self) -> float:
        return self.media_rows / self.pictures if self.pictures else 0.0

    @property
    def reused_share(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "rows_per_picture": round(self.rows_per_picture, 3),
            "reused_share": round(self.reused_share, 4),
        }

    def lines(self) -> list[str]:
        """The report as a person reads it."""
        out = [
            f"rows: {self.job_rows:,} in the job, {self.todo:,} to do ({self.done_before:,} done before)",
            f"shared: {_n(self.grouped, 'row')} in {_n(self.groups, 'group')} sharing a picture or prefix, "
            f"run side by side wherever they stand in the job",
            f"media: {_n(self.pictures, 'distinct picture')}, {_n(self.clips, 'clip')}; "
            f"{_n(self.media_rows, 'row')} with media, {self.rows_per_picture:.2f} rows per picture",
            f"prompt tokens: {self.prompt_tokens:,} ({self.media_tokens:,} image/video tokens); the prefix "
            f"cache would serve about {self.reused_tokens:,} ({self.reused_share:.0%} of prefill)",
            "lanes: " + (", ".join(f"{name} {n:,}" for name, n in sorted(self.lanes.items())) or "none"),
        ]
        out += [f"  one at a time ({n:,} rows): {why}" for why, n in sorted(self.one_at_a_time.items())]
        for what, rows in (("models", self.models), ("adapters", self.adapters)):
            if rows:  # each group runs once, one after another
                out.append(f"{what}: " + ", ".join(f"{name} {n:,}" for name, n in rows.items()))
        if self.failing:
            out.append("fail before generating: " + ", ".join(f"{s} {n:,}" for s, n in self.failing.items()))
        if (c := self.calibration) is not None:
            out.append(
                f"calibration: {c.rows} rows, {c.row_s:.2f} s a row ({c.prefill_s:.2f} s prefill, "
                f"{c.decode_s:.2f} s decode; +{c.once_s:.1f} s once, {c.load_s:.1f} s model load); "
                f"projected run: {_duration(c.projected_s)}"
            )
        elif self.todo:
            out.append(
                "time: not projected (the weights are not read); --calibrate N generates N rows "
                "and projects the run's wall time from them"
            )
        out.append(f"planned in {self.plan_s:.1f} s")
        return out


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class _Counts:
    """The figures gathered row by row, in plan order."""

    def __init__(self, cache_entries: int):
        self.pictures: set[bytes] = set()
        self.clips: set[bytes] = set()
        self.media_rows = self.prompt_tokens = self.media_tokens = self.reused = 0
        self.lanes: Counter[str] = Counter()
        self.models: Counter[str] = Counter()
        self.adapters: Counter[str] = Counter()
        self.failing: Counter[str] = Counter()
        self._cache: OrderedDict[str, None] = OrderedDict()  # the prefix cache's keys, LRU like it
        self._entries = cache_entries

    def media(self, job: Job) -> None:
        self.media_rows += bool(job.media)
        for ref in job.media:  # by digest: a dataset's pictures held as bytes are never kept
            source = ref.source if isinstance(ref.source, bytes) else str(ref.source).encode()
            (self.pictures if ref.kind == "image" else self.clips).add(
                hashlib.blake2b(source, digest_size=8).digest()
            )

    def planned(self, plan: Plan, tokens: int, media_ids: set[int]) -> None:
        self.lanes[plan.lane.name] += 1
        self.prompt_tokens += tokens
        seq = plan.seq
        if seq is None:
            return
        self.media_tokens += sum(t in media_ids for t in seq.ids)
        hit = max((pos for pos, key in seq.boundaries if key in self._cache), default=0)
        self.reused += hit
        for _, key in seq.boundaries:
            self._cache[key] = None
            self._cache.move_to_end(key)
        while len(self._cache) > self._entries:
            self._cache.popitem(last=False)


def plan_job(config: RunConfig, calibrate: int = 0) -> PlanReport:
    """The plan of a run of `config`, changing nothing on disk. Errors that would stop the run
    (unreadable job, duplicate ids, settings that differ from the output's) stop it too."""
    if config.stages:
        raise ConfigError("a staged job is planned by execution.plan_stages, a stage at a time")
    started = time.perf_counter()
    index = open_job(config)
    scan_s = time.perf_counter() - started
    writer = writer_for(config, index)
    resume = resume_of(config, index, writer, writer.peek())
    grouping = Grouping(index, resume.done)
    if calibrate and config.models:
        raise ConfigError("--calibrate with --models: calibrate each model's rows in a plan of their own")
    works = {model.model: work_settings(model, index.base) for model in config.per_model()}
    counts = _Counts(config.cache_entries if config.cache else 0)
    horizon = config.plan_horizon * 2**20
    first: list[RawRow] = []  # the rows a calibration runs: the plan's first
    with tempfile.TemporaryDirectory(prefix="batchgen-plan-") as tmp:
        planners = {path: _Planner(work, Path(tmp)) for path, work in works.items()}
        rows = resume.pending.rows()
        for raw in grouping.ordered(rows, horizon, config.window) if horizon else rows:
            if len(first) < calibrate:
                first.append(raw)
            _count(raw, config, planners, counts)
    f = grouping.figures
    one_at_a_time: Counter[str] = Counter()
    for planner in planners.values():
        one_at_a_time.update(planner.generator.stats().one_at_a_time)
    report = PlanReport(
        len(index.output_ids),
        resume.todo,
        resume.done_before,
        f.grouped,
        f.groups,
        len(counts.pictures),
        len(counts.clips),
        counts.media_rows,
        counts.prompt_tokens,
        counts.media_tokens,
        counts.reused,
        dict(counts.lanes),
        dict(counts.models),
        dict(counts.adapters),
        dict(one_at_a_time),
        dict(counts.failing),
    )
    report.plan_s = time.perf_counter() - started
    if first:
        report.calibration = _calibrate(works[config.model], first, resume.todo, scan_s)
    return report


class _Planner:
    """One model's planning: its generator (the weights mapped, not read) and its media stage."""

    def __init__(self, work: WorkSettings, tmp: Path):
        self.generator = Generator(work.generation, threading.Event(), lazy=True)
        self.stage = media_stage(work, tmp, self.generator)


def _count(raw: RawRow, config: RunConfig, planners: dict[str, _Planner], counts: _Counts) -> None:
    job = parse_job(raw, config)
    if job.error:
        counts.failing["read"] += 1
        return
    if config.models:
        counts.models[job.model or config.model_name] += 1
    if job.adapter is not None or config.adapters:
        counts.adapters[job.adapter or (Path(config.adapter).name if config.adapter else BASE_ADAPTER)] += 1
    planner = planners[config.model_for(job.model)]
    stage, generator = planner.stage, planner.generator
    counts.media(job)
    media = Media()
    if job.media:
        prepared = stage.resolve(job)
        if prepared.error is not None:
            counts.failing[prepared.error.stage] += 1
            return
        media = prepared.media
    planned = generator.plan([(job, media)])
    for failed in planned.failed:
        counts.failing[failed.error.stage if failed.error is not None else "generate"] += 1
    if planned.plans:  # its first completion: the others share its prompt
        plan = planned.plans[0]
        media_ids = generator.media_token_ids() if job.media else set()
        counts.planned(plan, generator.prompt_tokens(plan), media_ids)


def _calibrate(work: WorkSettings, rows: list[RawRow], todo: int, scan_s: float) -> Calibration:
    """Run `rows` for real (into no output) as Calibration says, and project the whole run."""
    generator = Generator(work.generation, threading.Event())
    half = max(1, len(rows) // 2)
    jobs = [parse_job(r, work) for r in rows]
    with tempfile.TemporaryDirectory(prefix="batchgen-calibrate-") as tmp:
        stage = media_stage(work, Path(tmp), generator)
        t0 = time.perf_counter()
        generator.load(vision=any(j.media for j in jobs), text=any(not j.media for j in jobs))
        load_s = time.perf_counter() - t0
        first = _timed(jobs[:half], stage, generator)
        rest = jobs[half:] or jobs[:half]
        prefill = _timed(rest, stage, generator, max_tokens=1)
        copies = max(1, work.generation.batch_size // len(rest))
        decode = _timed(rest, stage, generator, completions=copies)
    prefill_s, decode_s = prefill / len(rest), decode / (len(rest) * copies)
    once_s = max(first - (prefill_s + decode_s) * half, 0.0)
    projected = scan_s + load_s + once_s + (prefill_s + decode_s) * todo
    return Calibration(len(rows), load_s, once_s, prefill_s, decode_s, projected)


def _timed(jobs: list[Job], stage: MediaStage, generator: Generator, **params: Any) -> float:
    """Seconds these rows take through the media stage and a window's generation, with
    `params` (max_tokens, completions) in place of their own."""
    t0 = time.perf_counter()
    window = []
    for job in jobs:
        if params and not job.error:
            job = dataclasses.replace(job, params=dataclasses.replace(job.params, **params))
        window.append((job, stage.resolve(job) if job.media and not job.error else None))
    for _ in generate_window(window, generator):
        pass
    return time.perf_counter() - t0

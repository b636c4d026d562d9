"""The run's figures: printed at its end, saved as `<output>.stats.json`, shown while it runs."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.budget import human_bytes
from ..core.errors import gist, plural
from ..core.figures import GROUPED_BY, MAX_GROUPS, CacheStats, MemoryStats, RowGroup
from ..input.parse import near_miss
from .executor import ExecutorStats

__all__ = ["RunSummary", "Progress", "finish", "progress", "TRACE", "FAILED_EXIT", "INCOMPLETE_EXIT"]

FAILED_EXIT = 1  # failed rows (which ones count: --fail-on)
INCOMPLETE_EXIT = 4  # rows left to do (--limit, --time-limit), under --require-complete

TRACE = 5  # the log level of a line per row (`-vv`); DEBUG is a line per window and lane (`-v`)
logging.addLevelName(TRACE, "TRACE")


@dataclass(slots=True)
class RunSummary:
    """The figures printed at the end and saved as `<output>.stats.json`."""

    output: str
    rows: int = 0  # rows the output holds
    job_rows: int = 0  # rows of the job it is the output of (its --shard's)
    pending: int = 0  # ... not in it yet (a --limit, or a job grown since): a rerun does them
    complete: bool = True  # pending == 0: a reader may take the output as the whole job
    ok: int = 0
    failed: int = 0
    failed_now: int = 0  # ... of them failed by this run (the rest failed earlier and were not retried)
    failed_earlier: int = 0
    resumed: int = 0  # rows taken from an earlier run instead of generated again
    generated: int = 0  # rows processed by this run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # ... of them a thinking model's reasoning
    cached_tokens: int = 0
    mtp_drafts: int = 0  # tokens proposed by the drafter
    mtp_accepted: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    repetitions: int = 0  # this run's rows the loop stop ended (finish_reason repetition)
    looped_again: int = 0  # rows an earlier run's loop stop ended, generated again (--redo-repetition)
    dropped_columns: list[str] = field(default_factory=list)  # input columns not carried to the output
    private_urls_allowed: bool = False  # the URL policy was off: loopback and private hosts reachable
    time_limited: bool = False  # --time-limit ended the run before its rows were all done
    errors_file: str | None = None  # where the failed rows are listed, when some failed
    errors_sha256: str | None = None  # ... and what was written there: a rerun knows the file for batchgen's
    wall_s: float = 0.0
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0  # completion tokens of this run's rows per second of wall time
    errors_by_stage: dict[str, int] = field(default_factory=dict)
    groups: dict[str, list[RowGroup]] = field(default_factory=dict)  # "model": each model's rows, if several
    commonest_errors: list[str] = field(default_factory=list)  # "12× fetch: HTTP 404 Not Found", …
    # The executors' figures: media work, generation's (prefix reuse, capped rows, rows one at a
    # time, adapter switches, model loads, the memory budget), the job's warnings.
    work: ExecutorStats = field(default_factory=ExecutorStats)

    def figures(self) -> dict[str, Any]:
        """The stats file's layout: this summary's fields, the executors' figures beside them
        (generation's at the top, as `model_loads`), each near miss with the field it looks meant for."""
        own = asdict(self)
        work = own.pop("work")
        near = {name: (n, near_miss(name) or "") for name, n in self.work.near_misses.items()}
        return own | work.pop("generation") | work | {"near_misses": near}

    def exit_code(self, fail_on: str = "any", require_complete: bool = False) -> int:
        """0; FAILED_EXIT for failed rows (`fail_on` any, new: failed by this run, none);
        else INCOMPLETE_EXIT for rows left to do when the run must complete."""
        failed = {"any": self.failed, "new": self.failed_now, "none": 0}[fail_on]
        if failed:
            return FAILED_EXIT
        return INCOMPLETE_EXIT if require_complete and not self.complete else 0

    def line(self) -> str:
        """The closing line: the counts, what this run's rows went through, then speed."""
        counts = (
            f"{plural(self.rows, 'row')}: {self.ok:,} ok, {self.failed:,} failed ({self.resumed:,} resumed)"
        )
        counts += self._state() + self._notes()
        if not self.generated:  # a cron rerun with nothing left: no speed to speak of
            return f"{counts} · nothing to do"
        thought = f" ({self.reasoning_tokens:,} reasoning)" if self.reasoning_tokens else ""
        return (
            f"{counts} · "
            f"tokens {self.prompt_tokens:,} prompt / {self.completion_tokens:,} completion"
            f"{thought}{self._reuse()} · "
            f"{self.wall_s:.1f} s, {self.rows_per_s:.2f} rows/s, {self.tokens_per_s:.1f} tok/s"
        )

    def _state(self) -> str:
        """Old failures apart from this run's (cron's mail is about tonight), and what is left to do."""
        said = ""
        if self.failed_earlier:
            earlier = f"{self.failed_earlier:,} failed earlier, not retried"
            said += f" · {earlier}; {self.failed_now:,} failed in this run"
        if not self.complete:
            how = (
                "stopped at --time-limit; rerun to go on"
                if self.time_limited
                else "rerun without --limit to finish"
            )
            said += (
                f" · incomplete: {self.rows:,} of {self.job_rows:,} rows, {self.pending:,} pending ({how})"
            )
        return said

    def _notes(self) -> str:
        """What the rows went through (capped, looped, alone, memory) and the warnings."""
        gen = self.work.generation
        said = (
            f" · {plural(gen.max_tokens_capped, 'row')} capped at the context"
            if gen.max_tokens_capped
            else ""
        )
        if self.looped_again:
            said += f" · {plural(self.looped_again, 'looping row')} generated again (--redo-repetition)"
        if self.repetitions:
            looped = plural(self.repetitions, "row")
            said += f" · {looped} stopped repeating themselves (finish_reason repetition)"
        said += "".join(
            f" · {plural(n, 'row')} one at a time ({why})" for why, n in gen.one_at_a_time.items()
        )
        if gen.adapter_switches:
            n = gen.adapter_switches
            said += f" · {n:,} adapter {'switch' if n == 1 else 'switches'}"
        if gen.model_loads > 1:
            said += f" · {gen.model_loads} model loads"
        said += _memory(gen.memory)
        said += "".join(
            f" · warning: {plural(n, 'row')} without media beside column {name!r}, which looks like media "
            f"(--image-column {name} or --video-column {name} to use it)"
            for name, n in self.work.unused_media.items()
        )
        said += "".join(
            f" · warning: {plural(n, 'row')} with field {name!r}, which batchgen does not read (did you mean "
            f"{meant!r}?)"
            for name, n in self.work.near_misses.items()
            if (meant := near_miss(name))
        )
        if self.dropped_columns:
            names = ", ".join(self.dropped_columns)
            said += f" · not copied to the output: {names} (binary; --keep-columns to keep)"
        if self.private_urls_allowed:
            said += (
                " · warning: private and loopback URLs were allowed (allow_private_urls, from "
                "--allow-private-urls, BATCHGEN_RUN_ALLOW_PRIVATE_URLS or a config)"
            )
        if self.commonest_errors:
            said += f" · commonest errors: {'; '.join(self.commonest_errors)}"
        if self.errors_file:
            said += f" · failed rows listed in {self.errors_file}"
        return said

    def _reuse(self) -> str:
        """Prefix reuse and draft acceptance, where there were any."""
        said = ""
        if c := self.work.generation.cache:
            said += (
                f" · prefix cache {c.prefix_hits:,} hits / {c.prefix_misses:,} misses "
                f"({c.prefix_hit_rate:.0%} of lookups), {c.prompt_tokens_saved:,} prompt tokens saved"
            )
        if self.mtp_drafts:
            said += (
                f" · drafts {self.mtp_accepted:,}/{self.mtp_drafts:,} accepted ({self.acceptance_rate:.0%})"
            )
        return said


def _memory(m: MemoryStats) -> str:
    """The closing line's words on what the memory budget did, when it did more than decide widths."""
    said = ""
    if m.out_of_memory:
        said += (
            f" · {m.out_of_memory} out-of-memory batches split in halves ({m.retried} rows run again), "
            f"batches held to {human_bytes(m.ceiling or 0)} after it"
        )
    if m.too_big:
        said += f" · {m.too_big} rows too big for the memory budget of {human_bytes(m.budget or 0)}"
    return said


@dataclass(slots=True)
class Progress:
    """What a run tells its caller as it goes (`batchgen.run(config, progress=...)`): once when
    it starts (`rows` 0), then after every batch it has committed."""

    summary: RunSummary  # this run's figures so far
    total: int  # rows this run has to do
    done_before: int  # rows earlier runs finished (resumed)
    retried: int  # failed rows tried again
    redone: int  # rows changed since their results, generated again (--changed redo)
    rows: int  # rows the batch just committed; 0 at the start
    cache: CacheStats | None  # prefix reuse so far
    elapsed: float  # seconds since the run started

    @property
    def tail(self) -> str:
        return progress(self.summary, self.cache, self.elapsed)


def finish(s: RunSummary, table: pa.Table, job_rows: int, wall: float) -> RunSummary:
    """Row counts come from the final table, token counts from this run's rows."""
    s.rows, s.job_rows = table.num_rows, job_rows
    s.pending = max(job_rows - table.num_rows, 0)
    s.complete = not s.pending
    s.ok = pc.sum(pc.equal(table.column("status"), "ok")).as_py() or 0  # counted in Arrow: no row objects
    s.failed = s.rows - s.ok
    s.failed_earlier = max(s.failed - s.failed_now, 0)
    s.resumed = table.num_rows - s.generated
    failed = table.filter(pc.not_equal(table.column("status"), "ok")) if s.failed else table.slice(0, 0)
    errors: Counter[tuple[str, str]] = Counter()
    # An output written before these columns existed (or an earlier version's) may lack them.
    stages, messages = (
        failed.column(c).to_pylist() if c in failed.column_names else [None] * failed.num_rows
        for c in ("error_stage", "error")
    )
    for stage, message in zip(stages, messages, strict=True):
        if stage:
            s.errors_by_stage[stage] = s.errors_by_stage.get(stage, 0) + 1
            errors[(stage, gist(message or "", stage))] += 1
    s.commonest_errors = [f"{n}× {stage}: {message}" for (stage, message), n in errors.most_common(3)]
    for column in GROUPED_BY:
        if column in table.column_names and len(groups := _groups(table, column)) > 1:
            s.groups[column] = groups
    s.acceptance_rate = round(s.mtp_accepted / s.mtp_drafts, 4) if s.mtp_drafts else 0.0
    s.wall_s = round(wall, 3)
    s.rows_per_s = round(s.generated / wall, 3) if wall > 0 else 0.0
    s.tokens_per_s = round(s.completion_tokens / wall, 1) if wall > 0 else 0.0
    return s


def _groups(table: pa.Table, column: str) -> list[RowGroup]:
    """The rows of each value of `column` and how many are ok, the largest groups first (at
    most MAX_GROUPS: one adapter per customer may make thousands)."""
    ok = pc.cast(pc.equal(table.column("status"), "ok"), pa.int64())
    keys = pc.fill_null(pc.cast(table.column(column), pa.string()), "")
    counted = pa.table({"key": keys, "ok": ok}).group_by("key").aggregate([("ok", "sum"), ("ok", "count")])
    columns = counted.to_pydict()  # by name: the key's place among them differs by pyarrow version
    groups = [
        RowGroup(value=key, rows=rows, ok=ok or 0)
        for key, rows, ok in zip(columns["key"], columns["ok_count"], columns["ok_sum"], strict=True)
    ]
    return sorted(groups, key=lambda g: (-g.rows, g.value))[:MAX_GROUPS]


def progress(s: RunSummary, cache: CacheStats | None, elapsed: float) -> str:
    """The bar's tail: tokens/s, cache hit rate, failed rows (tqdm shows rows/s itself)."""
    parts = [f"{s.completion_tokens / max(elapsed, 1e-9):.0f} tok/s"]
    if cache is not None and cache.prefix_hits + cache.prefix_misses:
        parts.append(f"prefix hits {cache.prefix_hit_rate:.0%}")
    parts.append(f"{s.failed} failed")
    return ", ".join(parts)

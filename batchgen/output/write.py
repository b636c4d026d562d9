"""Write stage: finished rows to part files as the run goes; the output whole at the end.

A single file: the previous output and the parts are merged in job order into a temporary
file, renamed over `out.parquet`, and the `.partial` folder goes.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from ..core.records import Result, Values
from ..core.settings import Fingerprint
from ..input.read import JobIndex, id_key
from .about import About, Standing
from .parts import Earlier, Parts, part_number, partial_dir
from .store import Store
from .tables import ROW_GROUP_ROWS, concat_tables, in_order, ordered, rows_to_table

if TYPE_CHECKING:
    from .pending import Pending

__all__ = [
    "WriteOptions",
    "Sink",
    "ResultWriter",
    "SingleFile",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteOptions:
    """How the writer writes; each default carries its reason."""

    flush_rows: int = 64  # rows per part file: a kill loses at most this many
    flush_seconds: float = 10.0  # ... or this much work, whichever comes first
    shard_rows: int = 100_000  # rows per shard (Shards)
    overwrite: bool = False  # earlier results are removed, not resumed
    left_out: frozenset[str] = frozenset()  # our columns the output does not hold (never KEPT_COLUMNS)
    answers: dict[str, str] | None = None  # the job's answer columns and kinds: every shard types them alike


class Sink(Protocol):
    """Another file made from the finished output (the OpenAI Batch output)."""

    def write(self, table: pa.Table) -> None: ...


class ResultWriter(ABC):
    """Buffers finished rows, flushes them as part files, and puts the output in place; a
    layout says where earlier rows are and how the final output is made. It only writes:
    what earlier rows mean for this run is resume.py's.

    `settings` (what decides the output's content) go into the parts' manifest and the
    output's metadata, for the next run's check; `about` is the rest of it, for readers.
    """

    sharded = False  # a folder of shards: parts wait inside it

    def __init__(
        self,
        output: Path | str,
        index: JobIndex,
        settings: Fingerprint,
        options: WriteOptions = WriteOptions(),
        skip: set[str] | frozenset[str] = frozenset(),
        about: About | None = None,
        sinks: Sequence[Sink] = (),
    ):
        self.output = output
        self.store = Store(str(output))
        self.index = index
        self.skip = skip  # input columns not carried
        self.about = about or About()
        self.settings = settings
        self.options = options
        self.sinks = sinks
        self.partial = partial_dir(output, self.sharded)
        self.parts = Parts(self.store, self.partial, settings, options.overwrite)
        self._buffer: list[tuple[Values, Result]] = []
        self._last_flush = time.monotonic()
        self._earlier: list[str] = []  # the finished output's files when the run began

    # -- what is there -----------------------------------------------------------------------
    def open(self) -> Earlier:
        """Make the output ready for this run's rows, and say what earlier runs left: with
        `overwrite` (or an interrupted one) their files go; parts already in the output go."""
        self._check()
        if self.options.overwrite:
            self.parts.clear()
            self._discard()
        finals, settings, where, self.parts.manifest["overwrite"] = self._look()
        covered = self._covered()
        parts = self.parts.files()
        self.parts.remove([p for p in parts if part_number(p) in covered])
        self.parts.last = max([0, *covered, *map(part_number, parts)])
        self._earlier = finals
        return Earlier(finals + self.parts.files(), settings, where)

    def peek(self) -> Earlier:
        """What `open` would say, changing nothing (batchgen plan): with `overwrite`, nothing."""
        if self.options.overwrite:
            return Earlier([], None, str(self.output))
        self._check()
        finals, settings, where, _ = self._look()
        return Earlier(finals + self.parts.files(), settings, where)

    def _look(self) -> tuple[list[str], Fingerprint | None, str, bool]:
        """The finished output's files, the settings earlier rows were made with, how to name
        them, and whether an interrupted --overwrite run left the parts (then only they count)."""
        settings, interrupted_overwrite = self.parts.earlier()
        overwrite = self.options.overwrite or interrupted_overwrite  # an interrupted --overwrite stays one
        where = f"partial results in {self.partial}" if settings is not None else str(self.output)
        finals = self._finals() if not overwrite else []
        if settings is None and finals:
            settings = About.of(self.store.metadata(finals[0])).settings
        return finals, settings, where, overwrite

    def _check(self) -> None:  # noqa: B027 - a hook: a single file has nothing to check
        """Refuse, before any work, an output this layout cannot take as its own."""

    def _discard(self) -> None:  # noqa: B027 - a hook: a single file is replaced whole
        """--overwrite: the finished output's files that a new run would not replace whole."""

    def _covered(self) -> set[int]:
        """Part numbers the finished output already holds (a killed run made them a shard)."""
        return set()

    @abstractmethod
    def _finals(self) -> list[str]:
        """The finished output's files."""

    # -- this run's rows -----------------------------------------------------------------------
    def expect(self, pending: Pending) -> None:  # noqa: B027 - a hook: only a mirrored output needs them
        """The rows this run will add (a mirrored output writes a job file's shard as soon as
        its last row is in)."""

    def add(self, raw: Values, result: Result) -> None:
        self._buffer.append((raw, result))
        due = time.monotonic() - self._last_flush >= self.options.flush_seconds
        if len(self._buffer) >= self.options.flush_rows or due:
            self.flush()

    def flush(self) -> int:
        """Put the buffered rows on disk as complete part files; the rows written."""
        self._last_flush = time.monotonic()
        rows = len(self._buffer)
        if rows:
            self._write_parts(self._buffer)
            self._buffer = []
        return rows

    def _write_parts(self, rows: list[tuple[Values, Result]]) -> None:
        self.parts.write(self._table(rows))

    def _table(self, rows: list[tuple[Values, Result]]) -> pa.Table:
        return rows_to_table(rows, self.index.schema, self.skip, self.options.answers)

    def _tidy(self, table: pa.Table) -> pa.Table:
        """Our columns last, the run's settings in the metadata."""
        table = table.select([n for n in ordered(table.column_names) if n not in self.options.left_out])
        about = replace(self.about, settings=self.settings)
        return table.replace_schema_metadata({**(table.schema.metadata or {}), **about.metadata()})

    # -- the end ---------------------------------------------------------------------------------
    def finalize(self) -> pa.Table:
        """The output in place, the parts gone, the sinks written from it; what it holds (a
        shard folder's: its id, status and error columns only)."""
        self.flush()
        table = self._finalize()
        for sink in self.sinks:
            sink.write(table)
        return table

    @abstractmethod
    def _finalize(self) -> pa.Table: ...


class SingleFile(ResultWriter):
    """One Parquet file in job order: the previous output and the parts merged and written
    whole, renamed into place."""

    def _finals(self) -> list[str]:
        return [str(self.output)] if self.store.exists(str(self.output)) else []

    def _finalize(self) -> pa.Table:
        keys = [id_key(i) for i in self.index.output_ids]
        output = str(self.output)
        parts = self.parts.files()
        if not parts and self._earlier and self.store.exists(output):
            previous = self.store.read_table(output)
            same = [id_key(i) for i in previous.column("id").to_pylist()] == keys
            if same and not set(previous.column_names) & self.options.left_out:
                self.parts.clear()  # nothing new: leave the output byte for byte
                return previous
        tables = [self.store.read_table(p) for p in self._earlier + parts]
        table = concat_tables(tables) if tables else rows_to_table([], self.index.schema)
        table = self._tidy(in_order(table, {k: i for i, k in enumerate(keys)}))
        pending = len(keys) - table.num_rows  # a --limit: a reader must not take it for the whole job
        standing = About(standing=Standing(complete=not pending, job_rows=len(keys), pending=pending))
        table = table.replace_schema_metadata({**table.schema.metadata, **standing.metadata()})
        self.store.makedirs(os.path.dirname(output) or ".")
        self.store.write_table(output, table, row_group_size=ROW_GROUP_ROWS)
        self.parts.clear()
        return table

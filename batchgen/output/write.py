"""Write stage: finished rows go to part files as the run goes; the output appears atomically.

Layout beside `out.parquet`:
  out.parquet.partial/manifest.json    what run the parts belong to
  out.parquet.partial/part-000001.parquet ...  finished rows, each file complete on disk
A finished run merges the previous output (if any) and the parts in job order into a
temporary file, renames it over `out.parquet` and removes the `.partial` folder.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.errors import ConfigError
from ..core.records import Result
from ..core.uris import is_uri
from ..input.read import JobIndex, id_key
from ..input.source import Source
from .store import OutputLock, Store, atomic_write
from .tables import ROW_GROUP_ROWS, concat_tables, in_order, ordered, rows_to_table

__all__ = [
    "WriteOptions", "Earlier", "ResultWriter", "OutputLock", "atomic_write", "partial_dir",
    "stats_path",
]  # fmt: skip

_SHARD_NAME = re.compile(r"part-\d{6,}\.parquet")  # a shard's (and a part's) file name


SETTINGS_KEY = b"batchgen.settings"  # Parquet metadata: the settings that made the output
MEDIA_BASE_KEY = b"batchgen.media_base"  # ... where the job's relative media paths start (for report)
MEDIA_POLICY_KEY = b"batchgen.media_policy"  # ... which local media the run could read: report reads no other
TEMPLATE_KEY = b"batchgen.prompt_template"  # ... the --prompt-template the prompts were made with
JOB_KEY = b"batchgen.job"  # ... the job (a local one's path), its id column and mapped media columns
COMPLETE_KEY = b"batchgen.complete"  # ... whether it holds every row of its job, and how many are pending


PARTS_KEY = b"batchgen.parts"  # a shard's metadata: the part numbers it was made of
INPUT_FILE_KEY = b"batchgen.input_file"  # a part's, in a mirrored output: the job file its rows come from


def partial_dir(output: Path | str, sharded: bool = False) -> Path | str:
    """Where parts wait: `out.parquet.partial/`, or `DIR/_partial/` inside a sharded output
    (readers of the folder skip names starting with `_`)."""
    name = f"{output}/_partial" if sharded else f"{output}.partial"
    return name if is_uri(str(output)) else Path(name)


def stats_path(output: Path | str, sharded: bool = False) -> Path | str:
    name = f"{output}/_stats.json" if sharded else f"{output}.stats.json"
    return name if is_uri(str(output)) else Path(name)


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """How the writer lays the output out; each default carries its reason."""

    flush_rows: int = 64  # rows per part file: a kill loses at most this many
    flush_seconds: float = 10.0  # ... or this much work, whichever comes first
    sharded: bool = False  # a folder of shards instead of one file
    shard_rows: int = 100_000  # rows per shard
    overwrite: bool = False  # earlier results are removed, not resumed
    left_out: frozenset[str] = frozenset()  # our columns the output does not hold (never KEPT_COLUMNS)
    mirrored: bool = False  # sharded: a shard per job file, named as it is (`00000.tar` → `00000.parquet`)
    answers: dict[str, str] | None = None  # the job's answer columns and kinds: every shard types them alike


@dataclass(slots=True)
class Earlier:
    """What earlier runs left in the output: the files holding their rows (the output or its
    shards, then the parts of an interrupted run) and the settings they were made with."""

    files: list[str]
    settings: dict[str, Any] | None  # None: nothing earlier says (no earlier rows)
    where: str  # how messages name them


class ResultWriter:
    """Buffers finished rows, flushes them as part files, and assembles the final output: one
    Parquet file in job order, or (`sharded`) a folder of Parquet shards of at most
    `shard_rows` rows each, made from the parts as they pile up, so no step ever holds the
    whole output. It only writes: what earlier rows mean for this run is resume.py's.

    `settings` (what decides the output's content) go into the parts' manifest and the
    output's metadata, for the next run's check; `about` is more metadata for readers.
    """

    def __init__(self, output: Path | str, index: JobIndex, settings: dict[str, Any],
                 options: WriteOptions = WriteOptions(), skip: set[str] | frozenset[str] = frozenset(),
                 about: dict[bytes, str] | None = None):  # fmt: skip
        self.output = output
        self.store = Store(str(output))
        self.index = index
        self.skip = skip  # input columns not carried
        self.about = {k: v.encode() for k, v in (about or {}).items()}
        self.settings = settings
        self.options = options
        self.sharded, self.shard_rows = options.sharded, options.shard_rows
        self.partial = partial_dir(output, options.sharded)
        self._buffer: list[tuple[dict[str, Any], Result]] = []
        self._last_flush = time.monotonic()
        self._pending_rows = 0  # rows in parts not yet made a shard (by this run)
        self._manifest = {"settings": settings, "overwrite": options.overwrite}
        self._earlier: list[str] = []
        self._parts = 0
        self.mirrored = options.sharded and options.mirrored and index.source is not None
        if self.mirrored:
            self._names = [f"{output}/{name}" for name in mirrored_names(index.source)]  # type: ignore[arg-type]
            self._position = {id_key(i): n for n, i in enumerate(index.output_ids)}
            self._file = index.files_of_output()  # by position
            self._todo: dict[int, int] = {}  # rows each job file still waits for in this run
            self._part_file: dict[str, int] = {}

    def open(self) -> Earlier:
        """Make the output ready for this run's rows, and say what earlier runs left: with
        `overwrite` (or an interrupted one) their files go; parts already made into a shard go."""
        partial = str(self.partial)
        overwrite = self.options.overwrite
        if self.sharded:
            self._check_folder()
        if overwrite:
            self.store.remove_tree(partial)
            for shard in self._shards():
                self.store.remove(shard)
        finals, settings, where, self._manifest["overwrite"] = self._look()
        covered = self._covered()
        for part in self._part_files():  # made into a shard before the run stopped: already there
            if _number(part) in covered:
                self.store.remove(part)
        self._parts = max([0, *covered, *map(_number, self._part_files())])
        self._earlier = finals
        return Earlier(finals + self._part_files(), settings, where)

    def peek(self) -> Earlier:
        """What `open` would say, changing nothing (batchgen plan): with `overwrite`, nothing."""
        if self.options.overwrite:
            return Earlier([], None, str(self.output))
        if self.sharded:
            self._check_folder()
        finals, settings, where, _ = self._look()
        return Earlier(finals + self._part_files(), settings, where)

    def _look(self) -> tuple[list[str], dict[str, Any] | None, str, bool]:
        """The finished output's files, the settings earlier rows were made with, how to name
        them, and whether an interrupted --overwrite run left the parts (then only they count)."""
        partial = str(self.partial)
        overwrite = self.options.overwrite
        manifest_path = f"{partial}/manifest.json"
        settings, where = None, str(self.output)
        if self.store.exists(manifest_path):
            manifest = json.loads(self.store.read_text(manifest_path))
            overwrite = overwrite or manifest.get("overwrite", False)  # an interrupted --overwrite stays one
            settings, where = manifest.get("settings") or {}, "partial results in " + partial
        finals = self._finals() if not overwrite else []
        if settings is None and finals:
            meta = self.store.metadata(finals[0])
            if SETTINGS_KEY in meta:
                settings = json.loads(meta[SETTINGS_KEY])
        return finals, settings, where, overwrite

    def _check_folder(self) -> None:
        """A shard folder holds batchgen's shards only: another tool's Parquet there (Spark's
        `part-00000-<uuid>.snappy.parquet`, a file without batchgen's columns) would be read
        as results, or overwritten, so the run is refused before any work."""
        for path in self.store.listed(str(self.output), "", ".parquet"):
            name = path.rsplit("/", 1)[-1]
            named = _SHARD_NAME.fullmatch(name) is not None or (self.mirrored and path in self._names)
            try:
                ours = {"id", "input_hash", "status"} <= set(self.store.metadata_schema(path).names)
            except (OSError, pa.ArrowException):
                ours = False
            if ours and not named and self.mirrored:  # its job file was removed or renamed since
                raise ConfigError(f"-o {self.output}/: {name} holds batchgen's results for a job file "
                                  f"no longer in the job ({name[:-8]}.* removed or renamed?); put that job "
                                  f"file back, or move {name} out of the folder")  # fmt: skip
            if not (ours and named):
                raise ConfigError(
                    f"-o {self.output}/: {name} is not a shard batchgen wrote; give a folder of "
                    "batchgen's shards or an empty one"
                )

    def _part_files(self) -> list[str]:
        return self.store.listed(str(self.partial), "part-", ".parquet")

    def _shards(self) -> list[str]:
        if not self.sharded:
            return []
        shards = self.store.listed(str(self.output), "part-", ".parquet")
        if self.mirrored:
            folders = {name.rsplit("/", 1)[0] for name in self._names}
            there = {p for folder in folders for p in self.store.listed(folder, "", ".parquet")}
            shards = [n for n in self._names if n in there] + shards
        return shards

    def _finals(self) -> list[str]:
        """The finished output's files: its shards, or the one file."""
        if self.sharded:
            return self._shards()
        return [str(self.output)] if self.store.exists(str(self.output)) else []

    def _covered(self) -> set[int]:
        """Part numbers already made into shards (each shard names the parts it holds)."""
        numbers: set[int] = set()
        for shard in self._shards():
            first, _, last = self.store.metadata(shard).get(PARTS_KEY, b"").decode().partition("-")
            if first and last:
                numbers.update(range(int(first), int(last) + 1))
        return numbers

    def _sources(self) -> list[str]:
        return self._earlier + self._part_files()

    def expect(self, keys: Iterable[str]) -> None:
        """The id keys this run will add: a mirrored output's shard is written as soon as its
        job file's last row is in (otherwise when the run ends)."""
        for key in keys:
            k = self._file_of(key)
            self._todo[k] = self._todo.get(k, 0) + 1

    def add(self, raw: dict[str, Any], result: Result) -> None:
        self._buffer.append((raw, result))
        due = time.monotonic() - self._last_flush >= self.options.flush_seconds
        if len(self._buffer) >= self.options.flush_rows or due:
            self.flush()
        if self.mirrored and (k := self._file_of(id_key(result.id))) in self._todo:
            self._todo[k] -= 1
            if not self._todo[k]:
                self.flush()
                self._make_mirrored(k)

    def flush(self) -> None:
        """Put the buffered rows on disk as one complete part file; a sharded output makes a
        shard once its parts hold `shard_rows` rows."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        partial = str(self.partial)
        if not self.store.exists(f"{partial}/manifest.json"):  # made with the first rows
            self.store.makedirs(partial)
            self.store.write_text(f"{partial}/manifest.json", json.dumps(self._manifest, indent=2) + "\n")
        groups: dict[int | None, list] = {None: self._buffer}
        if self.mirrored:  # a part holds one job file's rows
            groups = {}
            for raw, result in self._buffer:
                groups.setdefault(self._file_of(id_key(result.id)), []).append((raw, result))
        for k, rows in groups.items():
            table = rows_to_table(rows, self.index.schema, self.skip, self.options.answers)
            if k is not None:
                table = table.replace_schema_metadata({INPUT_FILE_KEY: str(k).encode()})
            self._parts += 1
            self.store.write_table(f"{partial}/part-{self._parts:06d}.parquet", table)
            self._pending_rows += table.num_rows
        self._buffer.clear()
        if self.sharded and not self.mirrored and self._pending_rows >= self.shard_rows:
            self._make_shard()

    def _make_shard(self) -> None:
        """The parts written so far as one shard, which names them; then the parts go."""
        parts = self._part_files()
        self._pending_rows = 0
        if not parts:
            return
        table = self._tidy(concat_tables([self.store.read_table(p) for p in parts]))
        numbers = sorted(map(_number, parts))
        meta = {**(table.schema.metadata or {}), PARTS_KEY: f"{numbers[0]}-{numbers[-1]}".encode()}
        shard = f"{self.output}/part-{numbers[0]:06d}.parquet"
        self.store.makedirs(str(self.output))
        self.store.write_table(shard, table.replace_schema_metadata(meta), row_group_size=ROW_GROUP_ROWS)
        for part in parts:
            self.store.remove(part)

    def _make_mirrored(self, k: int) -> None:
        """Job file k's output shard: what it held before and its parts, each id once (the
        latest record), in job order. Its parts go once it is written; a kill in between
        leaves parts that the next run merges again to the same shard."""
        parts = [p for p in self._part_files() if self._file_of_part(p) == k]
        target = self._names[k]
        sources = ([target] if self.store.exists(target) else []) + parts
        if not parts:
            return
        table = self._tidy(
            in_order(concat_tables([self.store.read_table(s) for s in sources]), self._position)
        )
        self.store.makedirs(target.rsplit("/", 1)[0])
        self.store.write_table(target, table, row_group_size=ROW_GROUP_ROWS)
        for part in parts:
            self.store.remove(part)

    def _write_empty(self) -> None:
        """An empty shard for each job file without rows (joins by shard find every name), with
        the columns the other shards have (a reader takes a folder's schema from one file)."""
        holding = set(self._file)
        empty = [
            name for k, name in enumerate(self._names) if k not in holding and not self.store.exists(name)
        ]
        if not empty:
            return
        written = [name for name in self._names if name not in empty and self.store.exists(name)]
        schema = self.store.metadata_schema(written[0]) if written else None
        if schema is not None:
            table = schema.empty_table()
        else:
            table = self._tidy(rows_to_table([], None, answers=self.options.answers))
        for name in empty:
            self.store.makedirs(name.rsplit("/", 1)[0])
            self.store.write_table(name, table)

    def _file_of(self, key: str) -> int:
        """The job file (its number) an output id key comes from, in a mirrored output."""
        return self._file[self._position[key]]

    def _file_of_part(self, part: str) -> int:
        if part not in self._part_file:
            self._part_file[part] = int(self.store.metadata(part).get(INPUT_FILE_KEY, b"-1"))
        return self._part_file[part]

    def _tidy(self, table: pa.Table) -> pa.Table:
        """Our columns last, the run's settings in the metadata."""
        table = table.select([n for n in ordered(table.column_names) if n not in self.options.left_out])
        meta = {**(table.schema.metadata or {}), SETTINGS_KEY: json.dumps(self.settings, sort_keys=True),
                **self.about}  # fmt: skip
        return table.replace_schema_metadata(meta)

    def finalize(self) -> pa.Table:
        """The output in place, the parts gone. One file: the previous output and the parts
        merged in job order and written whole. Shards: the last parts made a shard; what is
        returned is then the shards' id, status and error columns only."""
        self.flush()
        if self.mirrored:
            for k in sorted({self._file_of_part(p) for p in self._part_files()}):
                self._make_mirrored(k)
            self._write_empty()
        if self.sharded:
            self._make_shard()
            self.store.remove_tree(str(self.partial))
            columns = ["id", "status", "error", "error_stage"]
            shards = self._shards()
            tables = self._drop_superseded(shards, [self.store.read_table(s, columns) for s in shards])
            return (
                pa.concat_tables(tables, promote_options="permissive")
                if tables
                else rows_to_table([], None).select(columns)
            )
        parts = self._part_files()
        keys = [id_key(i) for i in self.index.output_ids]
        output = str(self.output)
        if not parts and self._earlier and self.store.exists(output):
            previous = self.store.read_table(output)
            same = [id_key(i) for i in previous.column("id").to_pylist()] == keys
            if same and not set(previous.column_names) & self.options.left_out:
                self.store.remove_tree(str(self.partial))  # nothing new: leave the output byte for byte
                return previous
        tables = [self.store.read_table(p) for p in self._sources()]
        table = concat_tables(tables) if tables else rows_to_table([], self.index.schema)
        table = self._tidy(in_order(table, {k: i for i, k in enumerate(keys)}))
        pending = len(keys) - table.num_rows  # a --limit: a reader must not take it for the whole job
        done = json.dumps({"complete": not pending, "pending": pending, "job_rows": len(keys)})
        table = table.replace_schema_metadata({**table.schema.metadata, COMPLETE_KEY: done.encode()})
        self.store.makedirs(os.path.dirname(output) or ".")
        self.store.write_table(output, table, row_group_size=ROW_GROUP_ROWS)
        self.store.remove_tree(str(self.partial))
        return table

    def _drop_superseded(self, shards: list[str], tables: list[pa.Table]) -> list[pa.Table]:
        """Each id once: a row written again (a retried failure, also one whose run was killed
        after its new record reached a part or shard) keeps its latest record, and the shards
        holding an earlier one are written again without it. Duplicates are found in Arrow,
        so only the few repeated ids are ever Python strings."""
        keys = [pc.cast(t.column("id"), pa.string()) for t in tables]
        if not keys:
            return tables
        counts = pc.value_counts(pa.chunked_array(keys, pa.string()))
        repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
        if not len(repeated):
            return tables
        places: list[list[int]] = []
        latest: dict[str, tuple[int, int]] = {}
        for k, column in enumerate(keys):
            rows = pc.indices_nonzero(pc.is_in(column, value_set=repeated)).to_pylist()
            places.append(rows)
            for j in rows:
                latest[column[j].as_py()] = (k, j)
        for k, (shard, rows) in enumerate(zip(shards, places, strict=True)):
            drop = {j for j in rows if latest[keys[k][j].as_py()] != (k, j)}
            if not drop:
                continue
            keep = pa.array([j for j in range(tables[k].num_rows) if j not in drop], pa.int64())
            self.store.write_table(
                shard, self.store.read_table(shard).take(keep), row_group_size=ROW_GROUP_ROWS
            )
            tables[k] = tables[k].take(keep)
        return tables


def mirrored_names(source: Source) -> list[str]:
    """Output shards named as the job's files, in their folders: `00000.tar` → `00000.parquet`
    (`a.jsonl` and `a.csv` in one folder cannot both be shards of one job: one format)."""
    names = [str(PurePosixPath(s.name).with_suffix(".parquet")) for s in source.shards]
    if len(set(names)) < len(names) or any(".." in PurePosixPath(n).parts for n in names):
        raise ConfigError(f"{source.given}: its files do not name distinct output shards; give -o a file")
    return names


def _number(path: str) -> int:
    """A part's number, from `part-000042.parquet`."""
    return int(path.rsplit("/", 1)[-1][len("part-") : -len(".parquet")])

"""Shard-folder layouts (`-o DIR/`): no step ever holds the whole output.

`Shards` makes a shard (`part-NNNNNN.parquet`, named for its first part, its metadata naming
every part it holds) whenever the parts hold `shard_rows` rows; `MirroredShards` writes a
shard per job file of a folder job, named as it is (`00000.tar` → `00000.parquet`), as soon as
that file's last row is in. A kill between a shard and the removal of its parts leaves parts
the next run recognises (covered) or merges again to the same shard.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.errors import ConfigError
from ..core.records import Result, Values
from ..input.read import JobIndex, id_key
from ..input.source import Source
from .parts import PARTS_KEY, part_number
from .pending import Pending
from .tables import ROW_GROUP_ROWS, concat_tables, in_order, rows_to_table
from .write import ResultWriter

__all__ = ["Shards", "MirroredShards", "mirrored_names"]

_SHARD_NAME = re.compile(r"part-\d{6,}\.parquet")  # a shard's (and a part's) file name
_SUMMARY_COLUMNS = ["id", "status", "error", "error_stage"]  # what finalize reads back from the shards


class _ShardFolder(ResultWriter):
    """What both shard layouts share: the folder holds batchgen's shards only, its shards are
    the finished output, and the run ends with the last parts made a shard, each id once."""

    sharded = True

    def _check(self) -> None:
        """Another tool's Parquet in the folder (Spark's `part-00000-<uuid>.snappy.parquet`, a
        file without batchgen's columns) would be read as results, or overwritten: refused
        before any work."""
        names = self._names_of_shards()
        for path in self.store.listed(str(self.output), "", ".parquet"):
            name = path.rsplit("/", 1)[-1]
            named = _SHARD_NAME.fullmatch(name) is not None or path in names
            try:
                ours = {"id", "input_hash", "status"} <= set(self.store.metadata_schema(path).names)
            except (OSError, pa.ArrowException):
                ours = False
            if ours and not named:
                self._stray(name)
            if not (ours and named):
                raise ConfigError(
                    f"-o {self.output}/: {name} is not a shard batchgen wrote; give a folder of "
                    "batchgen's shards or an empty one"
                )

    def _names_of_shards(self) -> set[str]:
        """Shard paths named for what they hold besides `part-NNNNNN.parquet`."""
        return set()

    def _stray(self, name: str) -> None:
        """batchgen's results under a name this run does not make."""

    def _finals(self) -> list[str]:
        return self.store.listed(str(self.output), "part-", ".parquet")

    def _discard(self) -> None:
        for shard in self._finals():
            self.store.remove(shard)

    def _covered(self) -> set[int]:
        """Part numbers already made into shards (each shard names the parts it holds)."""
        numbers: set[int] = set()
        for shard in self._finals():
            first, _, last = self.store.metadata(shard).get(PARTS_KEY, b"").decode().partition("-")
            if first and last:
                numbers.update(range(int(first), int(last) + 1))
        return numbers

    def _make_shard(self) -> None:
        """The parts written so far as one shard, which names them; then the parts go."""
        parts = self.parts.files()
        if not parts:
            return
        table = self._tidy(concat_tables([self.store.read_table(p) for p in parts]))
        numbers = sorted(map(part_number, parts))
        meta = {**(table.schema.metadata or {}), PARTS_KEY: f"{numbers[0]}-{numbers[-1]}".encode()}
        shard = f"{self.output}/part-{numbers[0]:06d}.parquet"
        self.store.makedirs(str(self.output))
        self.store.write_table(shard, table.replace_schema_metadata(meta), row_group_size=ROW_GROUP_ROWS)
        self.parts.remove(parts)

    def _finalize(self) -> pa.Table:
        self._make_shard()
        self.parts.clear()
        shards = self._finals()
        tables = self._drop_superseded(shards, [self.store.read_table(s, _SUMMARY_COLUMNS) for s in shards])
        if not tables:
            return rows_to_table([], None).select(_SUMMARY_COLUMNS)
        return pa.concat_tables(tables, promote_options="permissive")

    def _drop_superseded(self, shards: list[str], tables: list[pa.Table]) -> list[pa.Table]:
        """Each id once: a row written again (a retried failure, also one whose run was killed
        after its new record reached a part or shard) keeps its latest record, and the shards
        holding an earlier one are written again without it. Duplicates are found in Arrow, so
        only the few repeated ids are ever Python strings."""
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
        store = self.store
        for k, (shard, rows) in enumerate(zip(shards, places, strict=True)):
            drop = {j for j in rows if latest[keys[k][j].as_py()] != (k, j)}
            if not drop:
                continue
            keep = pa.array([j for j in range(tables[k].num_rows) if j not in drop], pa.int64())
            store.write_table(shard, store.read_table(shard).take(keep), row_group_size=ROW_GROUP_ROWS)
            tables[k] = tables[k].take(keep)
        return tables


class Shards(_ShardFolder):
    """A folder of shards of at most `shard_rows` rows, in the order rows finished."""

    _pending_rows = 0  # rows in parts not yet made a shard (by this run)

    def flush(self) -> int:
        rows = super().flush()
        self._pending_rows += rows
        if self._pending_rows >= self.options.shard_rows:
            self._pending_rows = 0
            self._make_shard()
        return rows


class MirroredShards(_ShardFolder):
    """A shard per job file of a folder job, named as it is, in job order."""

    def __init__(self, output: Path | str, index: JobIndex, *args: Any, **kwargs: Any):
        super().__init__(output, index, *args, **kwargs)
        if index.source is None:
            raise ValueError("a mirrored output needs the job's files")
        self._names = [f"{output}/{name}" for name in mirrored_names(index.source)]
        self._position = {id_key(i): n for n, i in enumerate(index.output_ids)}
        self._file = index.files_of_output()  # by position
        self._todo: dict[int, int] = {}  # rows each job file still waits for in this run

    def _names_of_shards(self) -> set[str]:
        return set(self._names)

    def _stray(self, name: str) -> None:
        raise ConfigError(
            f"-o {self.output}/: {name} holds batchgen's results for a job file "
            f"no longer in the job ({name[:-8]}.* removed or renamed?); put that job "
            f"file back, or move {name} out of the folder"
        )

    def _finals(self) -> list[str]:
        folders = {name.rsplit("/", 1)[0] for name in self._names}
        there = {p for folder in folders for p in self.store.listed(folder, "", ".parquet")}
        return [n for n in self._names if n in there] + super()._finals()

    def expect(self, pending: Pending) -> None:
        for key in pending.keys():
            k = self._file_of(key)
            self._todo[k] = self._todo.get(k, 0) + 1

    def add(self, raw: Values, result: Result) -> None:
        super().add(raw, result)
        if (k := self._file_of(id_key(result.id))) in self._todo:
            self._todo[k] -= 1
            if not self._todo[k]:
                self.flush()
                self._make_mirrored(k)

    def _write_parts(self, rows: list[tuple[Values, Result]]) -> None:
        """A part holds one job file's rows."""
        groups: dict[int, list[tuple[Values, Result]]] = {}
        for raw, result in rows:
            groups.setdefault(self._file_of(id_key(result.id)), []).append((raw, result))
        for k, group in groups.items():
            self.parts.write(self._table(group), input_file=k)

    def _make_mirrored(self, k: int) -> None:
        """Job file k's output shard: what it held before and its parts, each id once (the
        latest record), in job order. Its parts go once it is written; a kill in between
        leaves parts that the next run merges again to the same shard."""
        parts = [p for p in self.parts.files() if self.parts.input_file(p) == k]
        if not parts:
            return
        target = self._names[k]
        sources = ([target] if self.store.exists(target) else []) + parts
        table = self._tidy(
            in_order(concat_tables([self.store.read_table(s) for s in sources]), self._position)
        )
        self.store.makedirs(target.rsplit("/", 1)[0])
        self.store.write_table(target, table, row_group_size=ROW_GROUP_ROWS)
        self.parts.remove(parts)

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
        if written:
            table = self.store.metadata_schema(written[0]).empty_table()
        else:
            table = self._tidy(rows_to_table([], None, answers=self.options.answers))
        for name in empty:
            self.store.makedirs(name.rsplit("/", 1)[0])
            self.store.write_table(name, table)

    def _file_of(self, key: str) -> int:
        """The job file (its number) an output id key comes from."""
        return self._file[self._position[key]]

    def _finalize(self) -> pa.Table:
        for k in sorted({self.parts.input_file(p) for p in self.parts.files()}):
            self._make_mirrored(k)
        self._write_empty()
        return super()._finalize()


def mirrored_names(source: Source) -> list[str]:
    """Output shards named as the job's files, in their folders: `00000.tar` → `00000.parquet`
    (`a.jsonl` and `a.csv` in one folder cannot both be shards of one job: one format)."""
    names = [str(PurePosixPath(s.name).with_suffix(".parquet")) for s in source.shards]
    if len(set(names)) < len(names) or any(".." in PurePosixPath(n).parts for n in names):
        raise ConfigError(f"{source.given}: its files do not name distinct output shards; give -o a file")
    return names

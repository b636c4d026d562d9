"""Read stage: stream the rows of a job's files (JSONL, Parquet, CSV or WebDataset tars; one
file or many shards, local or remote: source.py), never a whole file at once."""

from __future__ import annotations

import bisect
import hashlib
import tarfile
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.constraints import merge_kinds, requested_kinds
from ..core.errors import JobFileError
from .formats import FORMATS
from .openai_batch import is_batch_request
from .rows import START, Mark, RawRow, ReadPolicy, checked, valid_id
from .source import Source, resolve

__all__ = [
    "RawRow", "Mark", "JobIndex", "iter_rows", "scan", "id_key", "valid_id", "shard_of", "holds_bytes",
    "checked",
]  # fmt: skip
_DIGEST = 16  # bytes of a row's fingerprint (RawRow.digest, 32 hex digits)
SHARE = 8  # bytes of a row's share key (what it shares with other rows; zeros: nothing)
NO_SHARE = bytes(SHARE)
_MARK_ROWS = 64  # JSONL/CSV rows between two marks: a reader starting at a row reads at most this many more


def id_key(value: Any) -> str:
    """Ids compare as text, so 7 and "7" are the same row in a job file and its output."""
    return str(value)


@dataclass(slots=True)
class JobIndex:
    """The ids of a job file in order, found by a first cheap pass before any work."""

    format: str
    ids: list[Any]
    schema: pa.Schema | None  # Parquet input keeps its column types in the output
    source: Source | None = None  # the job's files
    digests: bytearray | None = None  # RawRow.digest of each row, aligned with ids: 16 bytes a row
    columns: list[str] = field(default_factory=list)  # the file's columns (JSONL: the keys rows have)
    binary: set[str] = field(default_factory=set)  # columns holding bytes (images): not copied by default
    id_column: str | None = None  # where ids come from (--id-column)
    answers: dict[str, str] = field(default_factory=dict)  # answer columns of the rows' schemas, their union
    shares: bytearray | None = None  # each row's share key (SHARE bytes, aligned with ids): input/plan.py

    rows: list[int] | None = None  # the row indices kept by narrow(); None = every row
    kept_ids: list[Any] | None = None  # ids the output keeps, in order (the shard's); None = ids
    kept_rows: list[int] | None = None  # ... their row indices in the file
    marks: list[Mark] = field(default_factory=lambda: [START])  # where reading can start, by row index

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def base(self) -> str | None:
        """Where the job's relative media paths start (None: a remote job, or no files)."""
        return self.source.base if self.source is not None else None

    @property
    def output_ids(self) -> list[Any]:
        """The ids the output holds, in job order: a --limit narrows the work, never the output."""
        return self.kept_ids if self.kept_ids is not None else self.ids

    def digest(self, i: int) -> str:
        """RawRow.digest of the i-th row kept."""
        return self.digests[i * _DIGEST : (i + 1) * _DIGEST].hex()  # type: ignore[index]

    def share(self, i: int) -> bytes:
        """The i-th kept row's share key: rows with one key (a picture, a long prefix) reuse work."""
        return bytes(self.shares[i * SHARE : (i + 1) * SHARE]) if self.shares is not None else NO_SHARE

    def wheres(self, indices: list[int]) -> list[str]:
        """How messages name these rows (indices into ids), read again from the job: only
        failures need them, so the index does not hold one a row."""
        wanted = {(self.rows[i] if self.rows is not None else i): i for i in indices}
        found = {}
        for raw in iter_rows(self.source, id_column=self.id_column):  # type: ignore[arg-type]
            if raw.index in wanted:
                found[wanted[raw.index]] = raw.where
                if len(found) == len(wanted):
                    break
        return [found.get(i, f"row {i}") for i in indices]

    def narrow(self, shard: tuple[int, int] | None = None, limit: int | None = None) -> None:
        """Keep shard i of n, then work on its first `limit` rows. A row goes by its share key
        when it has one, else by its id: rows sharing a picture are one shard's, so no two
        machines encode it."""
        keep = [
            i for i, row_id in enumerate(self.ids)
            if shard is None or shard_of(row_id, shard[1], self.share(i)) == shard[0]
        ]  # fmt: skip
        self.kept_ids = [self.ids[i] for i in keep]
        self.kept_rows = [self.rows[i] for i in keep] if self.rows is not None else keep
        keep = keep[:limit] if limit is not None else keep
        self.rows = [self.rows[i] for i in keep] if self.rows is not None else keep
        self.ids = [self.ids[i] for i in keep]
        if self.digests is not None:
            d, n = self.digests, _DIGEST
            self.digests = bytearray(b"".join(d[i * n : (i + 1) * n] for i in keep))
        if self.shares is not None:
            d, n = self.shares, SHARE
            self.shares = bytearray(b"".join(d[i * n : (i + 1) * n] for i in keep))

    def files_of_output(self) -> list[int]:
        """Each output id's job file (its number in `source.shards`), in output order."""
        starts, files = [m.index for m in self.marks], [m.shard for m in self.marks]
        rows = self.kept_rows if self.kept_rows is not None else range(len(self.output_ids))
        return [files[bisect.bisect_right(starts, r) - 1] for r in rows]


def shard_of(row_id: Any, shards: int, share: bytes = NO_SHARE) -> int:
    """Which of `shards` shards a row belongs to: the same on every machine and every run;
    by its share key when it has one (see JobIndex.narrow)."""
    if share != NO_SHARE:
        return int.from_bytes(share, "big") % shards
    return int(hashlib.sha256(id_key(row_id).encode()).hexdigest()[:16], 16) % shards


def holds_bytes(type_: pa.DataType) -> bool:
    """Binary, or a struct or list holding binary (a Hugging Face image's {bytes, path})."""
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_) or pa.types.is_fixed_size_binary(type_):
        return True
    if pa.types.is_struct(type_):
        return any(holds_bytes(type_.field(i).type) for i in range(type_.num_fields))
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        return holds_bytes(type_.value_type)
    return False


def _has_bytes(value: Any) -> bool:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return True
    if isinstance(value, dict):
        return any(isinstance(v, (bytes, bytearray)) for v in value.values())
    if isinstance(value, list):
        return any(_has_bytes(v) for v in value[:4])
    return False


def _positioned(source: Source, start: Mark, bodies: bool = True) -> Iterator[tuple[RawRow, Mark]]:
    """Rows from `start` on, shard after shard, each with where reading can resume to get it
    again; without `bodies`, a tar's media members are not read (the scan needs headers only)."""
    several = len(source.shards) > 1
    read = FORMATS[source.format].read
    policy = ReadPolicy(source.caps, source.video_columns, bodies)
    for shard in range(start.shard, len(source.shards)):
        name = source.shards[shard].name if several else None
        index = start.index
        try:
            with source.open(shard) as f:
                for row, here in read(f, start, policy):
                    row.file = name
                    index = row.index + 1
                    yield row, here
        except JobFileError as e:
            raise JobFileError(f"{source.shards[shard].path}: {e}") from e
        except (OSError, pa.ArrowException, tarfile.TarError) as e:
            title = FORMATS[source.format].title
            raise JobFileError(f"{source.shards[shard].path}: not a readable {title} file ({e})") from e
        start = Mark(index, 0, index if source.format == "parquet" else 0, shard + 1)


def _source(job: Source | Path | str, fmt: str | None = None) -> Source:
    return job if isinstance(job, Source) else resolve(job, fmt)


def iter_rows(
    job: Source | Path | str, fmt: str | None = None, start: Mark | None = None, id_column: str | None = None
) -> Iterator[RawRow]:
    """Every row of the job in order (from `start`, a mark of `scan`); a row that does not
    parse carries its `error`; ids come from `id_column` when given."""
    for row, _ in _positioned(_source(job, fmt), start or START):
        row.id_column = id_column
        yield row


def scan(
    job: Source | Path | str,
    fmt: str | None = None,
    id_column: str | None = None,
    share: Callable[[RawRow], bytes] | None = None,
) -> JobIndex:
    """Check the job's files are readable and its ids unique, before any work starts; with
    `share`, each row's share key (SHARE bytes) is kept too, for the plan."""
    source = _source(job, fmt)
    fmt = source.format
    schemas: list[pa.Schema] = []
    if fmt == "parquet":
        for shard in range(len(source.shards)):
            try:
                with source.open(shard) as f:
                    schemas.append(pq.ParquetFile(f).schema_arrow)
            except (pa.ArrowException, OSError) as e:
                raise JobFileError(f"{source.shards[shard].path}: not a readable Parquet file ({e})") from e
    schema = _unified(schemas)
    ids: list[Any] = []
    digests = bytearray()
    shares = bytearray() if share is not None else None
    columns: dict[str, None] = {n: None for s in schemas for n in s.names}
    binary = {f.name for s in schemas for f in s if holds_bytes(f.type)}
    hashes = array("q")  # each id's hash: a set of a million ids would hold four times the memory
    answers: dict[str, str] = {}
    marks = [START]
    parsed = 0
    try:
        for row, mark in _positioned(source, START, bodies=False):
            changed = (
                mark.seek != marks[-1].seek if fmt == "parquet" else row.index - marks[-1].index >= _MARK_ROWS
            )
            if changed or mark.shard != marks[-1].shard:
                marks.append(mark)
            row.id_column = id_column
            parsed += row.error is None
            if isinstance(row.value, dict):
                if not schemas:
                    columns.update(dict.fromkeys(row.value))
                    binary.update(k for k, v in row.value.items() if k not in binary and _has_bytes(v))
                asked = row.value["body"] if is_batch_request(row.value) else row.value
                merge_kinds(answers, requested_kinds(asked))

            hashes.append(hash(id_key(row.id)))
            ids.append(row.id)
            digests += bytes.fromhex(row.digest)
            if shares is not None:
                shares += share(row)  # type: ignore[misc]
    except OSError as e:
        raise JobFileError(f"{source.given}: cannot read ({e})") from e
    if ids and not parsed and fmt == "jsonl":
        raise JobFileError(f"{source.given}: not a JSONL file (no line parses as JSON)")
    _check_unique(source, ids, hashes, id_column)
    return JobIndex(format=fmt, ids=ids, schema=schema, source=source, digests=digests,
                    marks=marks, columns=list(columns), binary=binary, id_column=id_column,
                    answers=answers, shares=shares)  # fmt: skip


def _check_unique(source: Source, ids: list[Any], hashes: array, id_column: str | None) -> None:
    """The first id that repeats an earlier one stops the run, naming both rows."""
    h = np.frombuffer(hashes, dtype=np.int64)
    order = np.argsort(h, kind="stable")  # equal hashes in job order
    same = np.flatnonzero(h[order[1:]] == h[order[:-1]])
    repeats = [int(order[k + 1]) for k in same if id_key(ids[order[k]]) == id_key(ids[order[k + 1]])]
    if not repeats:
        return
    second = min(repeats)
    key = id_key(ids[second])
    first = next(i for i, row_id in enumerate(ids) if id_key(row_id) == key)
    wheres = {}
    for raw in iter_rows(source, id_column=id_column):
        if raw.index in (first, second):
            wheres[raw.index] = raw.where
            if len(wheres) == 2:
                break
    raise JobFileError(
        f"{source.given}: duplicate id {ids[second]!r:.80} at {wheres.get(first, 'an earlier row')} and "
        f"{wheres.get(second, f'row {second}')}; ids must be unique"
    )


def _unified(schemas: list[pa.Schema]) -> pa.Schema | None:
    """One schema for all Parquet shards; None (values typed as they come) when they disagree."""
    if not schemas:
        return None
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None

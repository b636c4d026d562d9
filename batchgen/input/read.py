"""Read stage: stream a job's rows from its files, local or remote, never a whole file at once."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import tarfile
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.answers import merge_kinds
from ..core.constraints import requested_kinds
from ..core.errors import JobFileError
from ..core.records import RowId
from .formats import FORMATS
from .openai_batch import is_batch_request
from .rows import START, Mark, RawRow, ReadPolicy, checked, valid_id
from .source import Source, resolve

__all__ = [
    "RawRow",
    "Mark",
    "RowPicker",
    "Rows",
    "JobIndex",
    "iter_rows",
    "scan",
    "id_key",
    "valid_id",
    "shard_of",
    "holds_bytes",
    "checked",
]
_DIGEST = 16  # bytes of a row's fingerprint (RawRow.digest, 32 hex digits)
SHARE = 8  # bytes of a row's share key (what it shares with other rows; zeros: nothing)
NO_SHARE = bytes(SHARE)
_MARK_ROWS = 64  # JSONL/CSV rows between two marks: a reader starting at a row reads at most this many more


def id_key(value: object) -> str:
    """Ids compare as text, so 7 and "7" are the same row in a job file and its output."""
    return str(value)


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows of a job as aligned columns, a few bytes each: their ids, their indices in the
    job's files, their fingerprints (RawRow.digest, 16 bytes a row) and share keys (SHARE
    bytes a row: input/plan.py). `take` keeps some of them, in a new record."""

    ids: list[RowId]
    positions: list[int] | None = None  # each row's index in the files; None: 0, 1, 2, …
    digests: bytes | None = None
    shares: bytes | None = None  # None: the scan kept no share keys

    def __len__(self) -> int:
        return len(self.ids)

    def position(self, i: int) -> int:
        return self.positions[i] if self.positions is not None else i

    def digest(self, i: int) -> str:
        """RawRow.digest of the i-th row."""
        return self.digests[i * _DIGEST : (i + 1) * _DIGEST].hex() if self.digests is not None else ""

    def share(self, i: int) -> bytes:
        """The i-th row's share key: rows with one key (a picture, a long prefix) reuse work."""
        return bytes(self.shares[i * SHARE : (i + 1) * SHARE]) if self.shares is not None else NO_SHARE

    def take(self, keep: list[int]) -> Rows:
        """These rows (indices into this record), in this order."""

        def columns(data: bytes | None, n: int) -> bytes | None:
            return b"".join(data[i * n : (i + 1) * n] for i in keep) if data is not None else None

        positions = [self.position(i) for i in keep]
        return Rows(
            [self.ids[i] for i in keep],
            positions,
            columns(self.digests, _DIGEST),
            columns(self.shares, SHARE),
        )


@dataclass(frozen=True, slots=True)
class JobIndex:
    """What the scan found in a job before any work: its rows (ids, fingerprints, share keys),
    its columns, and where reading can start. `narrow` gives the index of a shard and limit."""

    format: str
    rows: Rows  # the rows this run works on (a --shard's, the first --limit of them)
    schema: pa.Schema | None  # Parquet input keeps its column types in the output
    source: Source | None = None  # the job's files
    columns: list[str] = field(default_factory=list)  # the file's columns (JSONL: the keys rows have)
    binary: set[str] = field(default_factory=set)  # columns holding bytes (images): not copied by default
    id_column: str | None = None  # where ids come from (--id-column)
    answers: dict[str, str] = field(default_factory=dict)  # answer columns of the rows' schemas, their union
    marks: list[Mark] = field(default_factory=lambda: [START])  # where reading can start, by row index
    kept: Rows | None = None  # the rows the output holds (a --shard's; a --limit narrows only the work)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> list[RowId]:
        return self.rows.ids

    @property
    def base(self) -> str | None:
        """Where the job's relative media paths start (None: a remote job, or no files)."""
        return self.source.base if self.source is not None else None

    @property
    def output(self) -> Rows:
        """The rows the output holds, in job order: a --limit narrows the work, never the output."""
        return self.kept if self.kept is not None else self.rows

    @property
    def output_ids(self) -> list[RowId]:
        return self.output.ids

    def mark_before(self, position: int) -> Mark:
        """The last mark at or before a row of the files: where reading it starts."""
        return self.marks[bisect.bisect_right([m.index for m in self.marks], position) - 1]

    def read(self, start: Mark = START) -> Iterator[RawRow]:
        """The job's rows from a mark of the scan, read again from its files."""
        if self.source is None:
            raise JobFileError("this job's rows were given, not read from files: nothing to read again")
        return iter_rows(self.source, start=start, id_column=self.id_column)

    def wheres(self, indices: list[int]) -> list[str]:
        """How messages name these rows (indices into `rows`), read again from the job: only
        failures need them, so the index does not hold one a row."""
        wanted = {self.rows.position(i): i for i in indices}
        found = {}
        start = self.mark_before(min(wanted)) if wanted else START
        for raw in self.read(start):
            if raw.index in wanted:
                found[wanted[raw.index]] = raw.where
                if len(found) == len(wanted):
                    break
        return [found.get(i, f"row {i}") for i in indices]

    def narrow(self, shard: tuple[int, int] | None = None, limit: int | None = None) -> JobIndex:
        """Shard i of n, then its first `limit` rows to work on. A row goes by its share key
        when it has one, else by its id: rows sharing a picture are one shard's, so no two
        machines encode it."""
        rows = self.rows
        keep = [
            i
            for i, row_id in enumerate(rows.ids)
            if shard is None or shard_of(row_id, shard[1], rows.share(i)) == shard[0]
        ]
        kept = rows.take(keep)
        work = kept.take(list(range(min(limit, len(kept))))) if limit is not None else kept
        return dataclasses.replace(self, rows=work, kept=kept)

    def files_of_output(self) -> list[int]:
        """Each output id's job file (its number in `source.shards`), in output order."""
        starts, files, out = [m.index for m in self.marks], [m.shard for m in self.marks], self.output
        return [files[bisect.bisect_right(starts, out.position(i)) - 1] for i in range(len(out))]


def shard_of(row_id: object, shards: int, share: bytes = NO_SHARE) -> int:
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


def _has_bytes(value: object) -> bool:
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


def _schemas(source: Source) -> list[pa.Schema]:
    """Each Parquet shard's schema (none for other formats), read from its footer."""
    schemas: list[pa.Schema] = []
    for shard in range(len(source.shards)) if source.format == "parquet" else ():
        try:
            with source.open(shard) as f:
                schemas.append(pq.ParquetFile(f).schema_arrow)
        except (pa.ArrowException, OSError) as e:
            raise JobFileError(f"{source.shards[shard].path}: not a readable Parquet file ({e})") from e
    return schemas


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
    schemas = _schemas(source)
    schema = _unified(schemas)
    ids: list[RowId] = []
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
    rows = Rows(ids, None, bytes(digests), bytes(shares) if shares is not None else None)
    return JobIndex(
        format=fmt,
        rows=rows,
        schema=schema,
        source=source,
        marks=marks,
        columns=list(columns),
        binary=binary,
        id_column=id_column,
        answers=answers,
    )


def _check_unique(source: Source, ids: list[RowId], hashes: array, id_column: str | None) -> None:
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


class RowPicker:
    """Reads chosen rows of a job, a few at a time, in job order: each pick continues where
    the last one stopped when that is no further back than the mark it is given."""

    def __init__(self, source: Source, id_column: str | None = None):
        self.source, self.id_column = source, id_column
        self._rows: Iterator[RawRow] | None = None
        self._next = -1  # the index the open reader yields next

    def pick(self, mark: Mark, indices: list[int]) -> list[RawRow]:
        """The rows at `indices` (ascending, none before `mark`)."""
        if self._rows is None or not mark.index <= self._next <= indices[0]:
            self._rows, self._next = iter_rows(self.source, start=mark, id_column=self.id_column), mark.index
        wanted, out = set(indices), []
        for row in self._rows:
            self._next = row.index + 1
            if row.index in wanted:
                out.append(row)
            if row.index >= indices[-1]:
                break
        return out

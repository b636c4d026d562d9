"""Read stage: stream the rows of a JSONL, Parquet or CSV job file, never the whole file at once."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import JobFileError
from .openai import row_id
from .params import NUMBERS

__all__ = [
    "RawRow", "Mark", "JobIndex", "detect_format", "iter_rows", "scan", "id_key", "valid_id",
    "shard_of",
]  # fmt: skip

_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}
# CSV cells are text: these columns are read as numbers, and `[...]` / `{...}` cells as JSON.
_CSV_NUMBERS = (*NUMBERS, "video_fps", "video_max_frames")
_BATCH_ROWS = 1024  # Parquet rows decoded at a time: bounded memory for any file size
_MARK_ROWS = 64  # JSONL/CSV rows between two marks: a reader starting at a row reads at most this many more


@dataclass(slots=True)
class RawRow:
    """One row as stored: `value` is what the line parsed to, `error` why it did not."""

    index: int
    line: int | None
    value: Any = None
    error: str | None = None
    id_column: str | None = None  # the column holding the id (--id-column); None: `id`

    @property
    def id(self) -> Any:
        """The row's `id` (a string or an integer), else its index. A line that is no JSON
        object, or whose id is of another type, is named by its place (`line-N`), so it can
        never take the id of a good row."""
        place = f"line-{self.line}" if self.line is not None else f"row-{self.index}"
        if not isinstance(self.value, dict):
            return place
        value = self.value.get(self.id_column) if self.id_column else row_id(self.value)
        if value is None:
            return self.index
        return value if valid_id(value) else place

    @property
    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.index}"

    @property
    def digest(self) -> str:
        """A fingerprint of the row's content, independent of key order and formatting."""
        body = (
            self.error if self.value is None else json.dumps(self.value, sort_keys=True, default=_digest_of)
        )
        return hashlib.sha256(str(body).encode()).hexdigest()[:32]


def _digest_of(value: Any) -> str:
    """What a row's fingerprint takes of a value JSON has no form for: bytes by their digest."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    return str(value)


@dataclass(frozen=True, slots=True)
class Mark:
    """Where reading can start again without reading what comes before: `seek` is a byte
    offset (JSONL, CSV) or a row group (Parquet); `base` the lines before the row (JSONL, CSV)
    or the row group's first row (Parquet)."""

    index: int
    seek: int
    base: int


START = Mark(0, 0, 0)


def valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def id_key(value: Any) -> str:
    """Ids compare as text, so 7 and "7" are the same row in a job file and its output."""
    return str(value)


@dataclass(slots=True)
class JobIndex:
    """The ids of a job file in order, found by a first cheap pass before any work."""

    format: str
    ids: list[Any]
    schema: pa.Schema | None  # Parquet input keeps its column types in the output
    digests: list[str] | None = None  # RawRow.digest of each row, aligned with ids
    wheres: list[str] | None = None  # how messages name each row (line N / row N)
    columns: list[str] = field(default_factory=list)  # the file's columns (JSONL: the keys rows have)
    id_column: str | None = None  # where ids come from (--id-column)

    rows: list[int] | None = None  # the row indices kept by narrow(); None = every row
    kept_ids: list[Any] | None = None  # ids the output keeps, in order (the shard's); None = ids
    marks: list[Mark] = field(default_factory=lambda: [START])  # where reading can start, by row index

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def output_ids(self) -> list[Any]:
        """The ids the output holds, in job order: a --limit narrows the work, never the output."""
        return self.kept_ids if self.kept_ids is not None else self.ids

    def narrow(self, shard: tuple[int, int] | None = None, limit: int | None = None) -> None:
        """Keep shard i of n (by a stable hash of the id), then work on its first `limit` rows."""
        keep = [
            i for i, row_id in enumerate(self.ids) if shard is None or shard_of(row_id, shard[1]) == shard[0]
        ]
        self.kept_ids = [self.ids[i] for i in keep]
        keep = keep[:limit] if limit is not None else keep
        self.rows = [self.rows[i] for i in keep] if self.rows is not None else keep
        self.ids = [self.ids[i] for i in keep]
        self.digests = [self.digests[i] for i in keep] if self.digests is not None else None
        self.wheres = [self.wheres[i] for i in keep] if self.wheres is not None else None


def shard_of(row_id: Any, shards: int) -> int:
    """Which of `shards` shards a row belongs to: the same on every machine and every run."""
    return int(hashlib.sha256(id_key(row_id).encode()).hexdigest()[:16], 16) % shards


def detect_format(path: Path, fmt: str | None = None) -> str:
    if fmt:
        if fmt not in ("jsonl", "parquet", "csv"):
            raise JobFileError(f"unknown --format {fmt!r} (expected jsonl, parquet or csv)")
        return fmt
    try:
        return _EXTENSIONS[path.suffix.lower()]
    except KeyError:
        raise JobFileError(
            f"{path}: cannot tell the format from the extension {path.suffix!r}; "
            "pass --format jsonl, parquet or csv"
        ) from None


_MAX_DEPTH = 64  # nesting levels of a row's values: deeper is no job row, and costs every reader
_SURROGATE = re.compile("[\ud800-\udfff]")


def _walk(value: Any) -> tuple[bool, str | None]:
    """(nested deeper than _MAX_DEPTH, the first string or key holding a lone surrogate) —
    JSON's "\\ud800" or a non-UTF-8 file name gives one, and no UTF-8 writer can store it."""
    stack = [(value, 1)]
    surrogate = None
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            surrogate = surrogate or (v if _SURROGATE.search(v) else None)
        elif isinstance(v, (dict, list)):
            if depth > _MAX_DEPTH:
                return True, surrogate
            for k, x in v.items() if isinstance(v, dict) else enumerate(v):
                stack.append((k, depth) if isinstance(k, str) else (None, depth))
                stack.append((x, depth + 1))
    return False, surrogate


def _cleaned(value: Any) -> Any:
    """The value with lone surrogates replaced by U+FFFD, so that an error row can still be written."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_cleaned(k): _cleaned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cleaned(v) for v in value]
    return value


def _checked(row: RawRow) -> RawRow:
    """A row whose value cannot be used becomes an error row that keeps what can be written:
    its columns that are not too deep, lone surrogates replaced."""
    deep, surrogate = _walk(row.value)
    if not deep and surrogate is None:
        return row
    if deep:
        row.error = f"nested deeper than {_MAX_DEPTH} levels"
    else:
        row.error = f"not valid Unicode: a lone surrogate in {surrogate!r:.60}"
    value = row.value if isinstance(row.value, dict) else {}
    row.value = {_cleaned(k): _cleaned(v) for k, v in value.items() if not _walk(v)[0]} or None
    return row


def _parse_json(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} at column {e.colno}"
    except RecursionError:
        return None, f"invalid JSON: nested deeper than {_MAX_DEPTH} levels"


def _iter_jsonl(path: Path, start: Mark) -> Iterator[tuple[RawRow, Mark]]:
    index, offset, line_no = start.index, start.seek, start.base
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            here = Mark(index, offset, line_no)
            offset, line_no = offset + len(raw), line_no + 1
            if here.seek == 0 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw.strip():
                continue
            row = RawRow(index=index, line=line_no)
            index += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                row.error = f"not valid UTF-8 (byte {e.start})"
                yield row, here
                continue
            row.value, row.error = _parse_json(text)
            yield (_checked(row) if row.error is None else row), here


def _iter_parquet(path: Path, start: Mark) -> Iterator[tuple[RawRow, Mark]]:
    f = _open_parquet(path)
    first = start.base  # the row group's first row
    for group in range(start.seek, f.num_row_groups):
        here = Mark(first, group, first)
        index = first
        for batch in f.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group]):
            skip = max(0, min(start.index - index, batch.num_rows))  # rows before the start
            if skip:
                batch, index = batch.slice(skip), index + skip
            try:
                rows = [RawRow(index=index + i, line=None, value=v) for i, v in enumerate(batch.to_pylist())]
            except (UnicodeDecodeError, pa.ArrowException):
                rows = _cell_by_cell(batch, index)
            for row in rows:
                yield (_checked(row) if row.error is None else row), here
            index += batch.num_rows
        first += f.metadata.row_group(group).num_rows


def _cell_by_cell(batch: pa.RecordBatch, index: int) -> list[RawRow]:
    """A batch holding values Python cannot take (invalid UTF-8 in a string column), one cell
    at a time: a bad cell is replaced (U+FFFD, or None) and makes its row an error row."""
    rows = [RawRow(index=index + i, line=None, value={}) for i in range(batch.num_rows)]
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            values = column.to_pylist()
        except (UnicodeDecodeError, pa.ArrowException):
            values = [None] * len(column)
            binary = column.cast(pa.binary()) if pa.types.is_string(column.type) else None
            for i in range(len(column)):
                try:
                    values[i] = column[i].as_py()
                except (UnicodeDecodeError, pa.ArrowException):
                    if binary is not None:
                        values[i] = binary[i].as_py().decode("utf-8", "replace")
                    rows[i].error = rows[i].error or f"column {name!r}: not valid UTF-8"
        for row, value in zip(rows, values, strict=True):
            row.value[name] = value
    return rows


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise JobFileError(f"{path}: not a readable Parquet file ({e})") from e


def _csv_cell(name: str, text: str) -> Any:
    if text == "":
        return None
    if name in _CSV_NUMBERS:
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text  # left for validation to name
    if text[:1] in "[{":
        value, error = _parse_json(text)
        return text if error else value
    return text


_LONE_CR = re.compile(rb"(?<=\r)(?!\n)")  # old Mac line ends: a line break, as text mode reads them


class _CsvLines:
    """The file's lines as text from a byte offset, counting what the csv reader has taken:
    a record's start is where reading can begin again."""

    def __init__(self, f: BinaryIO, offset: int):
        self.f, self.offset = f, offset
        f.seek(offset)

    def __iter__(self) -> Iterator[str]:
        for raw in self.f:
            for piece in _LONE_CR.split(raw):
                start, self.offset = self.offset, self.offset + len(piece)
                if start == 0 and piece.startswith(codecs.BOM_UTF8):  # not part of the header
                    piece = piece[len(codecs.BOM_UTF8) :]
                try:
                    yield piece.decode("utf-8")
                except UnicodeDecodeError as e:  # the byte named is the file's, not the line's
                    e.start, e.end = start + e.start, start + e.end
                    raise


def _iter_csv(path: Path, start: Mark) -> Iterator[tuple[RawRow, Mark]]:
    import csv

    try:
        csv.field_size_limit(2**31 - 1)  # a long prompt is a row (maybe too long), not an unreadable file
        with path.open("rb") as f:
            head = _CsvLines(f, 0)
            head_reader = csv.reader(head)
            header = next(head_reader, None)
            if header is None:
                return
            offset, base = (start.seek, start.base) if start.seek else (head.offset, head_reader.line_num)
            lines = _CsvLines(f, offset)
            reader = csv.DictReader(lines, fieldnames=header)
            index = start.index
            here = Mark(index, offset, base)
            for record in reader:
                value = {k: _csv_cell(k, v or "") for k, v in record.items() if k is not None}
                yield _checked(RawRow(index=index, line=base + reader.line_num, value=value)), here
                index += 1
                here = Mark(index, lines.offset, base + reader.line_num)
    except UnicodeDecodeError as e:
        raise JobFileError(f"{path}: not a UTF-8 CSV file ({e.reason} at byte {e.start})") from e
    except csv.Error as e:
        raise JobFileError(f"{path}: not a readable CSV file ({e})") from e


def _positioned(path: Path, fmt: str, start: Mark) -> Iterator[tuple[RawRow, Mark]]:
    """Rows from `start` on, each with where reading can resume to get it again."""
    return {"jsonl": _iter_jsonl, "parquet": _iter_parquet, "csv": _iter_csv}[fmt](path, start)


def iter_rows(
    path: Path, fmt: str, start: Mark | None = None, id_column: str | None = None
) -> Iterator[RawRow]:
    """Every row of the file in order (from `start`, a mark of `scan`); a row that does not
    parse carries its `error`; ids come from `id_column` when given."""
    for row, _ in _positioned(path, fmt, start or START):
        row.id_column = id_column
        yield row


def scan(path: Path, fmt: str | None = None, id_column: str | None = None) -> JobIndex:
    """Check the file is readable and its ids unique, before any work starts."""
    if not path.is_file():
        raise JobFileError(f"{path}: no such job file")
    fmt = detect_format(path, fmt)
    schema = _open_parquet(path).schema_arrow if fmt == "parquet" else None
    ids: list[Any] = []
    digests: list[str] = []
    wheres: list[str] = []
    columns: dict[str, None] = dict.fromkeys(schema.names) if schema is not None else {}
    first_seen: dict[str, str] = {}
    marks = [START]
    parsed = 0
    try:
        for row, mark in _positioned(path, fmt, START):
            if mark.seek != marks[-1].seek if fmt == "parquet" else row.index - marks[-1].index >= _MARK_ROWS:
                marks.append(mark)
            row.id_column = id_column
            parsed += row.error is None
            if schema is None and isinstance(row.value, dict):
                columns.update(dict.fromkeys(row.value))
            key = id_key(row.id)
            if key in first_seen:
                raise JobFileError(
                    f"{path}: duplicate id {row.id!r:.80} at {first_seen[key]} and {row.where}; "
                    "ids must be unique"
                )
            first_seen[key] = row.where
            ids.append(row.id)
            digests.append(row.digest)
            wheres.append(row.where)
    except OSError as e:
        raise JobFileError(f"{path}: cannot read ({e})") from e
    except pa.ArrowException as e:
        raise JobFileError(f"{path}: not a readable Parquet file ({e})") from e
    if ids and not parsed:
        raise JobFileError(f"{path}: not a JSONL file (no line parses as JSON)")
    return JobIndex(format=fmt, ids=ids, schema=schema, digests=digests, wheres=wheres, marks=marks,
                    columns=list(columns), id_column=id_column)  # fmt: skip

"""One job file's rows, by format: JSONL, Parquet and CSV here, WebDataset tars in
webdataset.py. Each reader streams from a mark (where reading can start again) and yields
every row with the mark that finds it again; a row that cannot be used carries its error."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import JobFileError
from .openai import row_id
from .params import NUMBERS
from .records import MEDIA_COLUMNS, ByteCaps
from .webdataset import iter_tar

__all__ = ["RawRow", "Mark", "START", "ReadPolicy", "valid_id", "checked", "READERS"]

# CSV cells are text: these columns are read as numbers, and `[...]` / `{...}` cells as JSON.
_CSV_NUMBERS = (*NUMBERS, "video_fps", "video_max_frames")
_BATCH_ROWS = 1024  # Parquet rows decoded at a time: bounded memory for any file size


@dataclass(slots=True)
class RawRow:
    """One row as stored: `value` is what the line parsed to, `error` why it did not."""

    index: int
    line: int | None
    value: Any = None
    error: str | None = None
    id_column: str | None = None  # the column holding the id (--id-column); None: `id`
    file: str | None = None  # the row's shard, when the job has several
    fingerprint: str | None = None  # the reader's own digest (a tar sample's, from its headers)

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
        at = f"line {self.line}" if self.line is not None else f"row {self.index}"
        return f"{self.file} {at}" if self.file else at

    @property
    def digest(self) -> str:
        """A fingerprint of the row's content, independent of key order and formatting."""
        if self.fingerprint is not None:
            return self.fingerprint
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
    """Where reading can start again without reading what comes before: in shard `shard`,
    `seek` is a byte offset (JSONL, CSV, tar) or a row group (Parquet); `base` the lines
    before the row (JSONL, CSV) or the row group's first row (Parquet). Indices count rows
    across shards."""

    index: int
    seek: int
    base: int
    shard: int = 0


START = Mark(0, 0, 0)


@dataclass(frozen=True, slots=True)
class ReadPolicy:
    """What a reader may hold of a row: media bytes (binary cells, tar members) up to their
    kind's cap, never read whole past it; `bodies` False (the scan) reads no tar media body."""

    caps: ByteCaps = ByteCaps()
    video_columns: tuple[str, ...] = ()  # besides `video`, `videos`: mapped with --video-column
    bodies: bool = True

    def column_cap(self, name: str) -> tuple[str, int]:
        """A binary column's kind and cap: a media column's own, else the image cap."""
        kind = "video" if name in self.video_columns else MEDIA_COLUMNS.get(name, "image")
        return kind, self.caps.of(kind)


def valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


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


def checked(row: RawRow) -> RawRow:
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


def _iter_jsonl(f: BinaryIO, start: Mark, policy: ReadPolicy) -> Iterator[tuple[RawRow, Mark]]:
    index, offset, line_no = start.index, start.seek, start.base
    f.seek(offset)
    for raw in f:
        here = Mark(index, offset, line_no, start.shard)
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
        yield (checked(row) if row.error is None else row), here


_BATCH_BYTES = 64 * 2**20  # ... and fewer when the rows are large (binary cells): bounded either way


def _iter_parquet(file: BinaryIO, start: Mark, policy: ReadPolicy) -> Iterator[tuple[RawRow, Mark]]:
    f = pq.ParquetFile(file)
    first = start.base  # the row group's first row
    for group in range(start.seek, f.num_row_groups):
        here = Mark(first, group, first, start.shard)
        index = first
        meta = f.metadata.row_group(group)
        columns, skipped = _readable_columns(f, group, policy)
        per_row = meta.total_byte_size // max(1, meta.num_rows)
        rows_at_once = max(1, min(_BATCH_ROWS, _BATCH_BYTES // max(1, per_row)))
        for batch in f.iter_batches(batch_size=rows_at_once, row_groups=[group], columns=columns):
            skip = max(0, min(start.index - index, batch.num_rows))  # rows before the start
            if skip:
                batch, index = batch.slice(skip), index + skip
            batch, too_big = _capped(batch, policy)
            try:
                rows = [RawRow(index=index + i, line=None, value=v) for i, v in enumerate(batch.to_pylist())]
            except (UnicodeDecodeError, pa.ArrowException):
                rows = _cell_by_cell(batch, index)
            for i, row in enumerate(rows):
                row.error = row.error or too_big.get(i) or skipped
            for row in rows:
                yield (checked(row) if row.error is None else row), here
            index += batch.num_rows
        first += meta.num_rows


def _readable_columns(
    f: pq.ParquetFile, group: int, policy: ReadPolicy
) -> tuple[list[str] | None, str | None]:
    """The columns of a row group to read, and why every row of it is an error: a binary
    column whose chunk holds more than its cap for each of its rows holds at least one cell
    over the cap (one, when the group is one row), so it is never decoded."""
    meta = f.metadata.row_group(group)
    schema = f.schema_arrow
    names = list(schema.names)
    problem = None
    for j in range(meta.num_columns):
        column = meta.column(j)
        name = column.path_in_schema
        if name not in names or not _is_binary(schema.field(name).type):
            continue
        kind, cap = policy.column_cap(name)
        if column.total_uncompressed_size > cap * max(1, meta.num_rows):
            names.remove(name)
            what = f"{column.total_uncompressed_size:,} bytes"
            if meta.num_rows > 1:
                what += f" for {meta.num_rows} rows in row group {group}"
            problem = problem or f"column {name!r}: {what}, over the {kind} cap ({cap:,} bytes)"
    return (names if problem else None), problem


def _is_binary(type_: pa.DataType) -> bool:
    return pa.types.is_binary(type_) or pa.types.is_large_binary(type_)


def _capped(batch: pa.RecordBatch, policy: ReadPolicy) -> tuple[pa.RecordBatch, dict[int, str]]:
    """The batch with every top-level binary cell over its column's cap made null, and each
    such row's problem: a cell that size is no media item, and is never copied into Python."""
    problems: dict[int, str] = {}
    columns = list(batch.columns)
    for k, (name, column) in enumerate(zip(batch.schema.names, columns, strict=True)):
        if not _is_binary(column.type):
            continue
        kind, cap = policy.column_cap(name)
        lengths = pc.binary_length(column)
        over = pc.fill_null(pc.greater(lengths, cap), False)
        if not pc.any(over).as_py():
            continue
        for i in pc.indices_nonzero(over).to_pylist():
            problems.setdefault(i, f"column {name!r}: {lengths[i].as_py():,} bytes, over the {kind} cap "
                                   f"({cap:,} bytes)")  # fmt: skip
        columns[k] = pc.if_else(over, pa.nulls(len(column), column.type), column)
    return (pa.RecordBatch.from_arrays(columns, schema=batch.schema) if problems else batch), problems


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


def _iter_csv(f: BinaryIO, start: Mark, policy: ReadPolicy) -> Iterator[tuple[RawRow, Mark]]:
    import csv

    try:
        csv.field_size_limit(2**31 - 1)  # a long prompt is a row (maybe too long), not an unreadable file
        head = _CsvLines(f, 0)
        head_reader = csv.reader(head)
        header = next(head_reader, None)
        if header is None:
            return
        offset, base = (start.seek, start.base) if start.seek else (head.offset, head_reader.line_num)
        lines = _CsvLines(f, offset)
        reader = csv.DictReader(lines, fieldnames=header)
        index = start.index
        here = Mark(index, offset, base, start.shard)
        for record in reader:
            value = {k: _csv_cell(k, v or "") for k, v in record.items() if k is not None}
            yield checked(RawRow(index=index, line=base + reader.line_num, value=value)), here
            index += 1
            here = Mark(index, lines.offset, base + reader.line_num, start.shard)
    except UnicodeDecodeError as e:
        raise JobFileError(f"not a UTF-8 CSV file ({e.reason} at byte {e.start})") from e
    except csv.Error as e:
        raise JobFileError(f"not a readable CSV file ({e})") from e


READERS = {"jsonl": _iter_jsonl, "parquet": _iter_parquet, "csv": _iter_csv, "webdataset": iter_tar}

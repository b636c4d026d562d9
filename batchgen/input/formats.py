"""One job file's rows, by format: JSONL, Parquet and CSV here, WebDataset tars in webdataset.py.

Each reader streams from a mark (where reading can start again) and yields every row with the
mark that finds it again; a row that cannot be used carries its error.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.errors import JobFileError
from ..core.params import NUMBERS
from .rows import MAX_DEPTH, Mark, RawRow, ReadPolicy, checked
from .webdataset import iter_tar

__all__ = ["Format", "FORMATS", "EXTENSIONS"]

# CSV cells are text: these columns are read as numbers, and `[...]` / `{...}` cells as JSON.
_CSV_NUMBERS = (*NUMBERS, "video_fps", "video_max_frames")
_BATCH_ROWS = 1024  # Parquet rows decoded at a time: bounded memory for any file size


def _parse_json(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} at column {e.colno}"
    except RecursionError:
        return None, f"invalid JSON: nested deeper than {MAX_DEPTH} levels"


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
            problems.setdefault(
                i, f"column {name!r}: {lengths[i].as_py():,} bytes, over the {kind} cap ({cap:,} bytes)"
            )
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


def csv_cell(name: str, text: str) -> Any:
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
            value = {k: csv_cell(k, v or "") for k, v in record.items() if k is not None}
            yield checked(RawRow(index=index, line=base + reader.line_num, value=value)), here
            index += 1
            here = Mark(index, lines.offset, base + reader.line_num, start.shard)
    except UnicodeDecodeError as e:
        raise JobFileError(f"not a UTF-8 CSV file ({e.reason} at byte {e.start})") from e
    except csv.Error as e:
        raise JobFileError(f"not a readable CSV file ({e})") from e


@dataclass(frozen=True, slots=True)
class Format:
    """A job file format: its name (`--format`), the extensions that select it, how messages
    name its files, and its reader."""

    name: str
    extensions: tuple[str, ...]
    title: str
    read: Callable[[BinaryIO, Mark, ReadPolicy], Iterator[tuple[RawRow, Mark]]]


# The job formats, in the order messages and --help list them.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("jsonl", (".jsonl", ".ndjson", ".json"), "JSONL", _iter_jsonl),
        Format("parquet", (".parquet", ".pq"), "Parquet", _iter_parquet),
        Format("csv", (".csv",), "CSV", _iter_csv),
        Format("webdataset", (".tar",), "WebDataset tar", iter_tar),
    )
}
EXTENSIONS = {ext: f.name for f in FORMATS.values() for ext in f.extensions}

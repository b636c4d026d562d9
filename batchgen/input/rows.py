"""A job row as read (RawRow), where reading restarts (Mark), what a reader holds, and its checks."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..core.params import SEEDED_SAMPLER, seeded
from ..core.records import MEDIA_COLUMNS, ByteCaps, RowId
from .openai_batch import row_id

__all__ = ["RawRow", "Mark", "START", "ReadPolicy", "valid_id", "checked", "MAX_DEPTH"]


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
    def id(self) -> RowId:
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
        if seeded(self.value):  # its draws are the sampler's as much as the row's
            body = f"{body}|sampler {SEEDED_SAMPLER}"
        return hashlib.sha256(str(body).encode()).hexdigest()[:32]


def _digest_of(value: object) -> str:
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


def valid_id(value: object) -> TypeGuard[RowId]:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


MAX_DEPTH = 64  # nesting levels of a row's values: deeper is no job row, and costs every reader


_SURROGATE = re.compile("[\ud800-\udfff]")


def _walk(value: object) -> tuple[bool, str | None]:
    """(nested deeper than MAX_DEPTH, the first string or key holding a lone surrogate) —
    JSON's "\\ud800" or a non-UTF-8 file name gives one, and no UTF-8 writer can store it."""
    stack = [(value, 1)]
    surrogate = None
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            surrogate = surrogate or (v if _SURROGATE.search(v) else None)
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
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
        row.error = f"nested deeper than {MAX_DEPTH} levels"
    else:
        row.error = f"not valid Unicode: a lone surrogate in {surrogate!r:.60}"
    value = row.value if isinstance(row.value, dict) else {}
    row.value = {_cleaned(k): _cleaned(v) for k, v in value.items() if not _walk(v)[0]} or None
    return row

"""`batchgen validate`: every problem of every row, found without loading a model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .errors import JobFileError
from .parse import parse_row
from .read import detect_format, id_key, iter_rows
from .records import GenParams

__all__ = ["validate_file"]


def validate_file(path: Path, fmt: str | None = None) -> Iterator[str]:
    """Yield one line per problem: `FILE:LINE: field: message` (or `FILE: row N: ...`)."""
    if not path.is_file():
        raise JobFileError(f"{path}: no such job file")
    fmt = detect_format(path, fmt)
    seen: dict[str, str] = {}
    rows = parsed = 0
    for raw in iter_rows(path, fmt):
        rows += 1
        where = f"{path}:{raw.line}" if raw.line is not None else f"{path}: row {raw.index}"
        job, problems = parse_row(raw, GenParams())
        parsed += raw.error is None
        for field, message in problems:
            yield f"{where}: {field}: {message}"
        key = id_key(job.id)
        if key in seen:
            yield f"{where}: id: duplicate id {job.id!r:.80} (first at {seen[key]})"
        else:
            seen[key] = raw.where
    if rows and not parsed:
        raise JobFileError(f"{path}: not a JSONL file (no line parses as JSON)")

"""`batchgen validate`: every problem of every row, found without loading a model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..core.errors import ConfigError, JobFileError
from ..core.records import GenParams
from ..core.settings import Columns
from .parse import parse_row, template_fields
from .read import id_key, iter_rows
from .source import resolve

__all__ = ["validate_file"]


def validate_file(
    path: Path, fmt: str | None = None, columns: Columns | None = None, template: str | None = None
) -> Iterator[str]:
    """Yield one line per problem: `FILE:LINE: field: message` (or `FILE: row N: ...`), the
    rows read as `run` reads them with this column mapping and prompt template. Columns the
    mapping names that the file lacks are a ConfigError, as in `run`."""
    source = resolve(path, fmt)
    columns = columns or Columns()
    if columns.prompt and template:
        raise ConfigError("give --prompt-column or --prompt-template, not both")
    named = [*columns.named(), *(("--prompt-template", f) for f in template_fields(template or ""))]
    seen: dict[str, str] = {}
    present: set[str] = set()
    rows = parsed = 0
    for raw in iter_rows(source, id_column=columns.id):
        rows += 1
        if isinstance(raw.value, dict):
            present.update(raw.value)
        file = raw.file or path
        where = f"{file}:{raw.line}" if raw.line is not None else f"{file}: row {raw.index}"
        job, problems = parse_row(raw, GenParams(), template, columns)
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
    missing = [f"{flag} {name!r}" for flag, name in named if rows and name not in present]
    if missing:
        raise ConfigError(
            f"{path}: no column {', '.join(missing)}; its columns: {', '.join(sorted(present))}"
        )

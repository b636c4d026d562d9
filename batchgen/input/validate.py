"""`batchgen validate`: every problem of every row, found without loading a model.

A problem repeated over rows is said once with its count, local media are checked to exist, and
fields one slip from a field batchgen reads are warned about once per file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError, JobFileError, plural
from ..core.params import GenParams
from ..core.records import Job
from ..core.settings import Columns
from .parse import near_miss, parse_row
from .read import id_key, iter_rows
from .source import resolve
from .template import has_field, template_fields

__all__ = ["Finding", "Validation", "validate_file"]

_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")
_GROUPS = 10_000  # distinct problems held per file to count repeats; more are said as they come


@dataclass(slots=True)
class Finding:
    """One line of `validate`: a problem of one row (or of `rows` rows alike, the first named),
    or a warning that does not fail the file."""

    where: str  # `FILE:LINE` or `FILE: row N` (N counted in that file, from 0)
    field: str
    message: str
    rows: int = 1
    warning: bool = False
    more: list[str] = dataclasses.field(default_factory=list)  # other rows it is in (`line 7`, `row 3`)

    def line(self) -> str:
        if self.warning:
            return f"{self.where}: warning: {self.field}: {self.message}"
        also = ""
        if self.rows > 1:
            shown = ", ".join(self.more) + (" …" if self.rows - 1 > len(self.more) else "")
            also = f" ({self.rows} rows alike; also {shown})"
        return f"{self.where}: {self.field}: {self.message}{also}"


def _missing_media(job: Job, base: str | None) -> Iterator[tuple[str, str]]:
    """Local media paths that name no regular file (as `run` resolves them, from the job's folder)."""
    for ref in job.media if base is not None else []:
        source = ref.source
        if not isinstance(source, str) or source.startswith("data:") or _SCHEME.match(source):
            continue  # a URL: `run` fetches it (or names its scheme)
        try:
            path = Path(source).expanduser()
            path = path if path.is_absolute() or base is None else Path(base) / path
            there = path.is_file()
        except (OSError, ValueError, RuntimeError):
            there = False
        if not there:
            yield ref.kind, f"no such file {source!r:.80}"


class Validation:
    """A job file's findings as they are found (iterate), and the rows read (`rows`, once done)."""

    def __init__(self, path: Path | str, fmt: str | None, columns: Columns | None, template: str | None):
        self.path, self.fmt, self.columns, self.template = path, fmt, columns, template
        self.rows = 0

    def __iter__(self) -> Iterator[Finding]:
        for finding, rows in _findings(self.path, self.fmt, self.columns, self.template):
            self.rows = rows
            if finding is not None:
                yield finding


def validate_file(
    path: Path | str, fmt: str | None = None, columns: Columns | None = None, template: str | None = None
) -> Validation:
    """Each problem of each row read as `run` reads it with this column mapping and prompt
    template, a file at a time. Columns the mapping names that the file lacks are a
    ConfigError, as in `run`."""
    return Validation(path, fmt, columns, template)


def _findings(
    path: Path | str, fmt: str | None, columns: Columns | None, template: str | None
) -> Iterator[tuple[Finding | None, int]]:
    """(finding, rows read so far); a last (None, rows) once the file is read."""
    source = resolve(path, fmt)
    columns = columns or Columns()
    if columns.prompt and template:
        raise ConfigError("give --prompt-column or --prompt-template, not both")
    named = [*columns.named(), *(("--prompt-template", f) for f in template_fields(template or ""))]
    seen: dict[str, str] = {}
    present: set[str] = set()
    rows = parsed = 0
    groups: dict[tuple[str, str], Finding] = {}
    slips: dict[str, int] = {}
    unused: dict[str, int] = {}  # columns that look like media, beside rows without media
    file, first = None, 0
    for raw in iter_rows(source, id_column=columns.id):
        name = raw.file or str(path)
        if name != file:
            yield from ((f, rows) for f in _said(file, groups, slips, unused))
            file, first = name, raw.index
        rows += 1
        if isinstance(raw.value, dict):
            present.update(raw.value)
        place = f"line {raw.line}" if raw.line is not None else f"row {raw.index - first}"
        where = f"{name}:{raw.line}" if raw.line is not None else f"{name}: {place}"
        job, problems = parse_row(raw, GenParams(), template, columns)
        parsed += raw.error is None
        if not problems:
            problems = list(_missing_media(job, source.base))
        for slip in job.near_misses:
            slips[slip] = slips.get(slip, 0) + 1
        for column in job.unused_media:
            unused[column] = unused.get(column, 0) + 1
        for field_name, message in problems:
            found = groups.get((field_name, message))
            if found is not None:
                found.rows += 1
                if len(found.more) < 3:
                    found.more.append(place)
            elif len(groups) < _GROUPS:
                groups[(field_name, message)] = Finding(where, field_name, message)
            else:
                yield Finding(where, field_name, message), rows
        key = id_key(job.id)
        if key in seen:
            yield Finding(where, "id", f"duplicate id {job.id!r:.80} (first at {seen[key]})"), rows
        else:
            seen[key] = raw.where
    yield from ((f, rows) for f in _said(file, groups, slips, unused))
    if rows and not parsed:
        raise JobFileError(f"{path}: not a JSONL file (no line parses as JSON)")
    missing = [f"{flag} {name!r}" for flag, name in named if rows and not has_field(present, name)]
    if missing:
        raise ConfigError(
            f"{path}: no column {', '.join(missing)}; its columns: {', '.join(sorted(present))}"
        )
    yield None, rows


def _said(
    file: str | None, groups: dict[tuple[str, str], Finding], slips: dict[str, int], unused: dict[str, int]
) -> Iterator[Finding]:
    """A file's problems, each once with its count, then its near-miss fields and the columns
    that look like media; all emptied."""
    yield from groups.values()
    for name, n in slips.items():
        meant = near_miss(name)
        said = f"in {plural(n, 'row')}, not one batchgen reads (did you mean {meant!r}? it is kept as data)"
        yield Finding(str(file), f"field {name!r}", said, warning=True)
    for name, n in unused.items():
        said = (
            f"looks like media, beside {plural(n, 'row')} without media; --image-column {name} or "
            f"--video-column {name} to use it"
        )
        yield Finding(str(file), f"column {name!r}", said, warning=True)
    groups.clear()
    slips.clear()
    unused.clear()

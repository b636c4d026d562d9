"""A results file (or shard folder) read back by the tools that look at it: `inspect`,
`report` and `export`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import JobFileError
from ..core.records import RESULT_COLUMNS
from ..output.tables import RESULT_SCHEMA

__all__ = ["read_results", "results_schema", "results_metadata"]

_NEEDED = ("id", "status", "error", "error_stage")  # every output keeps these (KEPT_COLUMNS)


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rows, with every column of ours (those the output left out: empty, or 0)."""
    table = _table(path)
    for name in RESULT_COLUMNS:
        if name not in table.column_names:
            type_ = RESULT_SCHEMA.field(name).type
            empty = pa.scalar(0 if pa.types.is_integer(type_) or pa.types.is_floating(type_) else None, type_)
            table = table.append_column(pa.field(name, type_), pa.repeat(empty, table.num_rows))
    return table.to_pylist()


def _table(path: Path):
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise JobFileError(f"{path}: not a batchgen results file ({e})") from e
    missing = [c for c in _NEEDED if c not in table.column_names]
    if missing:
        raise JobFileError(
            f"{path}: not a batchgen results file (no {', '.join(missing)} column); "
            "give the output of `batchgen run`"
        )
    return table


def results_schema(path: Path) -> pa.Schema:
    """The output's columns and metadata (a shard folder: its first shard's)."""
    files = [path]
    if path.is_dir():  # its shards, named `part-000001` or as the job's files; `_partial/` is not one
        shards = (
            p for p in path.rglob("*.parquet") if not p.relative_to(path).as_posix().startswith(("_", "."))
        )
        files = sorted(shards)
    return pq.read_schema(files[0]) if files else pa.schema([])


def results_metadata(path: Path) -> dict[bytes, bytes]:
    return results_schema(path).metadata or {}

"""A results file (or shard folder) read back by the tools that look at it: `inspect`,
`report` and `export`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import JobFileError

__all__ = ["read_results", "results_schema", "results_metadata"]

_NEEDED = ("id", "status", "error", "error_stage", "generated_text", "prompt_tokens", "completion_tokens")


def read_results(path: Path) -> list[dict[str, Any]]:
    return _table(path).to_pylist()


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
    files = sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]
    return pq.read_schema(files[0]) if files else pa.schema([])


def results_metadata(path: Path) -> dict[bytes, bytes]:
    return results_schema(path).metadata or {}

"""`batchgen merge`: the outputs of a job's --shard i/N runs as one output in job order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError
from ..input.read import JobIndex, id_key
from .store import atomic_write
from .tables import ROW_GROUP_ROWS, concat_tables

__all__ = ["merge_outputs"]


def merge_outputs(parts: list[Path], index: JobIndex, out: Path) -> tuple[int, list[Any], list[Any]]:
    """Shard outputs → one output in job order. Returns (rows written, ids missing from every
    part, ids found in more than one place); a duplicated id keeps its first occurrence."""
    tables = []
    for path in parts:
        try:
            tables.append(pq.read_table(path))
        except (OSError, pa.ArrowException) as e:
            raise ConfigError(f"{path}: not a readable results file ({e})") from e
    table = concat_tables(tables)
    position = {id_key(i): n for n, i in enumerate(index.ids)}
    first: dict[str, int] = {}
    duplicated = []
    for row, row_id in enumerate(table.column("id").to_pylist()):
        key = id_key(row_id)
        if key in first:
            duplicated.append(row_id)
        elif key in position:
            first[key] = row
    missing = [i for i in index.ids if id_key(i) not in first]
    order = sorted(first, key=position.__getitem__)
    table = table.take(pa.array([first[k] for k in order], pa.int64()))
    meta = dict(tables[0].schema.metadata or {})
    table = table.replace_schema_metadata(meta)
    atomic_write(out, lambda p: pq.write_table(table, p, row_group_size=ROW_GROUP_ROWS))
    return table.num_rows, missing, duplicated

"""One batchgen run of a list of rows, timed, for the benchmarks that compare runs side by side
in one process: the wall time of `batchgen.run` and the output rows."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import batchgen


def timed_run(rows: list[dict], generation: dict[str, Any], **overrides: Any) -> tuple[float, list[dict]]:
    """`rows` as a JSONL job run with these generation defaults and RunConfig fields."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "jobs.jsonl", Path(tmp) / "out.parquet"
        job.write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = batchgen.build_config(job, out, None, generation, quiet=True, **overrides)
        t0 = time.perf_counter()
        batchgen.run(config)
        wall = time.perf_counter() - t0
        return wall, pq.read_table(out).to_pylist()

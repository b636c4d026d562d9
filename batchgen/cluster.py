"""Scale-out on Ray Data: the same rows, stages and output as the local engine, with the
media and generation stages in a pool of actors, one model load each.

The driver reads the job file with batchgen's own reader (robust to rows Arrow cannot type),
skips what is already done, and hands the rest to Ray as a dataset of raw rows. Each actor
resolves media (its own fetch pool) and generates with the batched engine, returning a
fixed-schema Arrow table per batch: a failed row stays a row, never a failed block. The
driver commits the results through the same writer as a local run, so resume, the lock,
the settings check and the final atomic output are the local engine's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

from .config import RunConfig
from .errors import ConfigError
from .records import Result
from .write import RESULT_SCHEMA

__all__ = ["run_on_ray", "RowWorker"]

_OUT_SCHEMA = pa.schema([("row", pa.string()), ("id_json", pa.string()), *RESULT_SCHEMA])


class RowWorker:
    """A Ray actor: loads the models once, then turns batches of raw rows into results."""

    def __init__(self, config: RunConfig):
        from .engine import Engines
        from .media import MediaStage

        self.config = config
        self.engines = Engines.from_config(config)
        self.engines.load_drafter()
        self.tmp = tempfile.mkdtemp(prefix="batchgen-ray-")
        info = self.engines.vision_info
        self.stage = MediaStage(
            config.media, config.input.parent, Path(self.tmp), info.audio, info.max_pixels
        )

    def __call__(self, batch: dict[str, Any]) -> pa.Table:
        from concurrent.futures import ThreadPoolExecutor

        from .parse import parse_row
        from .read import RawRow
        from .runner import generate_window

        jobs = []
        for packed in batch["row"]:
            r = json.loads(packed)
            raw = RawRow(index=r["index"], line=r["line"], value=r["value"], error=r["error"])
            jobs.append(parse_row(raw, self.config.defaults, self.config.prompt_template)[0])
        with ThreadPoolExecutor(self.config.media.fetch_workers) as pool:
            futures = [pool.submit(self.stage.resolve, j) if j.media and not j.error else None for j in jobs]
            window = [(j, f.result() if f else None) for j, f in zip(jobs, futures, strict=True)]
        packed_of = {id(j): p for j, p in zip(jobs, batch["row"], strict=True)}
        out: dict[str, list] = {name: [] for name in _OUT_SCHEMA.names}
        for results in generate_window(window, self.engines, self.config.batch_size):
            for job, result in results:
                out["row"].append(packed_of[id(job)])
                out["id_json"].append(json.dumps(result.id))
                for field in RESULT_SCHEMA:
                    out[field.name].append(getattr(result, field.name))
        return pa.table(out, schema=_OUT_SCHEMA)


def _pack(raw) -> str:
    return json.dumps(
        {"index": raw.index, "line": raw.line, "value": raw.value, "error": raw.error}, default=str
    )


def _start_ray(config: RunConfig, temp_dir: str) -> bool:
    """Join `ray_address`, or start a local instance; False when one was already running."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token in the home directory
    if config.ray_address:
        ray.init(address=config.ray_address, logging_level="WARNING", log_to_driver=False)
        return True
    # More logical CPUs than actors: actors holding every CPU would starve Ray's read task.
    cpus = max(os.cpu_count() or 1, config.workers) + 2
    ray.init(num_cpus=cpus, include_dashboard=False, _temp_dir=temp_dir, logging_level="WARNING",
             log_to_driver=False)  # fmt: skip
    return True


def run_on_ray(config: RunConfig, rows: list, on_result) -> None:
    """Generate `rows` (RawRows not yet done) on Ray, committing each result via `on_result`."""
    try:
        import ray
        from ray.data import ActorPoolStrategy
    except ImportError as e:
        raise ConfigError("--engine ray needs Ray: pip install 'batchgen[ray]'") from e
    if not rows:
        return
    temp_dir = tempfile.mkdtemp(prefix="bg-ray-")  # short: Ray's socket paths must stay short
    started = False
    try:
        started = _start_ray(config, temp_dir)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # batchgen's own bar counts committed rows
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        blocks = max(config.workers * 2, 1)
        ds = ray.data.from_items([{"row": _pack(r)} for r in rows]).repartition(min(blocks, len(rows)))
        results = ds.map_batches(
            RowWorker,
            fn_constructor_kwargs={"config": config},
            compute=ActorPoolStrategy(size=config.workers),
            batch_size=config.batch_size,
            batch_format="numpy",
            num_cpus=0.5,  # fractional: leaves room for Ray's own tasks
        )
        for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
            for record in batch.to_pylist():
                packed = json.loads(record.pop("row"))
                record["id"] = json.loads(record.pop("id_json"))
                on_result(packed, Result(**record))
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

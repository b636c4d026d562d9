"""Scale-out on Ray Data: `RayExecutor` has the local executor's interface, with the media
and generation stages in a pool of actors, one model load each.

The driver reads the job file with batchgen's own reader (robust to rows Arrow cannot type),
skips what is already done, and hands the rest to Ray as a dataset of raw rows. Each actor
runs the local executor on its share (media overlapping generation, rows grouped over the
window) and sends back results and its figures, not the rows: the driver keeps them. The
driver loads no model; it commits through the same writer as a local run, so progress,
stop requests, resume, the lock, the settings check and the final atomic output are the
local engine's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from .config import RunConfig, WorkSettings, work_settings
from .errors import ConfigError
from .execute import merge_stats
from .read import RawRow
from .records import Job, Result
from .write import RESULT_SCHEMA

__all__ = ["RayExecutor", "RowWorker"]

_OUT_SCHEMA = pa.schema(
    [
        ("pos", pa.int64()),
        ("id_json", pa.string()),
        *RESULT_SCHEMA,
        ("worker", pa.string()),
        ("stats", pa.string()),
    ]
)


class RowWorker:
    """A Ray actor: loads the models once, then runs the local executor on batches of rows."""

    def __init__(self, work: WorkSettings, tmp_root: str | None = None):
        from .engine import Engines
        from .execute import LocalExecutor

        self.tmp = tempfile.mkdtemp(prefix="batchgen-ray-", dir=tmp_root)
        atexit.register(shutil.rmtree, self.tmp, True)  # tmp_root, when the driver gives one, goes too
        engines = Engines.from_config(work.engine)
        self.executor = LocalExecutor(work, engines, Path(self.tmp), threading.Event())
        self.worker = uuid.uuid4().hex

    def __call__(self, batch: dict[str, Any]) -> pa.Table:
        rows, pos_of = [], {}
        for pos, packed in zip(batch["pos"], batch["row"], strict=True):
            r = json.loads(packed)
            rows.append(RawRow(index=r["index"], line=r["line"], value=r["value"], error=r["error"]))
            pos_of[r["index"]] = int(pos)
        out: dict[str, list] = {name: [] for name in _OUT_SCHEMA.names}
        for results in self.executor.run(rows):
            for job, result in results:
                out["pos"].append(pos_of[job.index])
                out["id_json"].append(json.dumps(result.id))
                for field in RESULT_SCHEMA:
                    out[field.name].append(getattr(result, field.name))
        n = len(out["pos"])
        out["worker"] = [self.worker] * n
        out["stats"] = [json.dumps(self.executor.stats())] * n  # cumulative: the driver keeps the latest
        return pa.table(out, schema=_OUT_SCHEMA)


def _pack(raw: RawRow) -> str:
    return json.dumps(
        {"index": raw.index, "line": raw.line, "value": raw.value, "error": raw.error}, default=str
    )


def _start_ray(config: RunConfig, temp_dir: str) -> bool:
    """Join `ray_address`, or start a local instance; False when one was already running."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token in the home directory
    # ray.init installs its own SIGINT/SIGTERM handlers: the run's own (flush, exit 130/143) stay.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if config.ray_address:
            ray.init(address=config.ray_address, logging_level="WARNING", log_to_driver=False)
        else:
            # More logical CPUs than actors: actors holding every CPU would starve Ray's read task.
            cpus = max(os.cpu_count() or 1, config.workers) + 2
            ray.init(num_cpus=cpus, include_dashboard=False, _temp_dir=temp_dir, logging_level="WARNING",
                     log_to_driver=False)  # fmt: skip
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    return True


class RayExecutor:
    """Raw rows in, results out, like LocalExecutor; the work happens in Ray actors. A set
    `stop` ends the run between two result batches."""

    def __init__(self, config: RunConfig, stop: threading.Event):
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ConfigError("--engine ray needs Ray: pip install 'batchgen[ray]'") from e
        self.config, self.stop = config, stop
        self._latest: dict[str, dict[str, Any]] = {}  # each actor's last figures

    def run(self, rows: Iterable[RawRow]) -> Iterator[list[tuple[Job, Result]]]:
        import ray
        from ray.data import ActorPoolStrategy

        c = self.config
        rows = list(rows)
        if not rows:
            return
        temp_dir = tempfile.mkdtemp(prefix="bg-ray-")  # short: Ray's socket paths must stay short
        started = False
        try:
            started = _start_ray(c, temp_dir)
            ray.data.DataContext.get_current().enable_progress_bars = False  # batchgen's bar counts rows
            logging.getLogger("ray.data").setLevel(logging.WARNING)
            items = [{"pos": pos, "row": _pack(r)} for pos, r in enumerate(rows)]
            ds = ray.data.from_items(items).repartition(min(max(c.workers * 2, 1), len(rows)))
            # An actor groups rows and overlaps media over a window, but never takes so many that
            # another actor idles: Ray Data coalesces blocks up to the batch size.
            batch_rows = min(c.window, max(c.batch_size, -(-len(rows) // (2 * c.workers))))
            local = started and not c.ray_address  # actors' temp folders inside ours, removed with it
            results = ds.map_batches(
                RowWorker,
                fn_constructor_kwargs={"work": work_settings(c), "tmp_root": temp_dir if local else None},
                compute=ActorPoolStrategy(size=c.workers),
                batch_size=batch_rows,
                batch_format="numpy",
                num_cpus=0.5,  # fractional: leaves room for Ray's own tasks
            )  # fmt: skip
            for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
                if self.stop.is_set():
                    return
                out = []
                for record in batch.to_pylist():
                    raw = rows[record.pop("pos")]
                    self._latest[record.pop("worker")] = json.loads(record.pop("stats"))
                    record["id"] = json.loads(record.pop("id_json"))
                    job = Job(index=raw.index, id=record["id"], line=raw.line)
                    job.raw = raw.value if isinstance(raw.value, dict) else {}
                    out.append((job, Result(**record)))
                if out:
                    yield out
        finally:
            if started:
                ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)

    def stats(self) -> dict[str, Any]:
        return merge_stats(list(self._latest.values()))

    def close(self) -> None:
        pass

"""Scale-out on Ray Data: the local executor's interface over a pool of actors, one model load each.

The driver holds no rows: it hands Ray a list of small items (where to start reading in the
job file, and a bitmap of the pending rows after it), and each actor reads its rows with
batchgen's own reader (robust to rows Arrow cannot type) — so the job file must be at the
same path on every node, as for Ray Data's own readers. Each actor runs the local executor
on its share (media overlapping generation, rows grouped over the window) and sends back
each row's output record (its input values and result) and its own figures. The driver
loads no model; it commits through the same writer as a local run, so progress, stop
requests, resume, the lock, the settings check and the final atomic output are the local
engine's.
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import signal
import tempfile
import threading
import uuid
from pathlib import Path
from typing import TypedDict

import pyarrow as pa

from ..core.errors import ConfigError, RunFailedError, short
from ..core.records import Finished, Result
from ..core.settings import RunConfig, work_settings
from ..core.uris import is_uri
from ..generate.generator import Generator, GeneratorFactory
from ..input.plan import Grouping
from ..input.read import Mark, RawRow, RowPicker
from ..input.source import Source
from ..output.pending import Pending
from ..output.tables import RESULT_SCHEMA
from .executor import Batches, Executor, ExecutorStats
from .local import LocalExecutor

__all__ = ["RayExecutor", "RowWorker"]

_OUT_SCHEMA = pa.schema(
    [
        ("where", pa.string()),  # how messages name the row
        ("id_json", pa.string()),
        ("value", pa.binary()),  # the row's input values, pickled: Parquet types survive
        *RESULT_SCHEMA,
        ("worker", pa.string()),
        ("stats", pa.string()),
    ]
)
_GAP = 64  # pending rows further apart than this start a new segment: an actor never reads far for nothing


class Segment(TypedDict):
    """Rows of an item that lie together: the mark to read from (index, seek, base, shard), the
    first row, and a bitmap of the wanted rows from there."""

    mark: list[int]
    first: int
    want: bytes


class Item(TypedDict):
    """What a Ray actor is handed: segments of the rows to read and run."""

    segments: list[Segment]


def pending_items(todo: Pending, per_item: int) -> list[Item]:
    """The pending rows as items of about `per_item` rows, in the plan's order: a group (rows
    sharing a picture) stays in one item up to 4 × `per_item` rows, so one actor encodes its
    picture. Each item is a list of segments: the mark to read from, the first row, and a
    bitmap of the wanted rows from there."""
    marks = todo.index.marks
    starts = [m.index for m in marks]

    def segment(rows: list[int]) -> Segment:
        mark = marks[bisect.bisect_right(starts, rows[0]) - 1]
        bits = bytearray((rows[-1] - rows[0]) // 8 + 1)
        for i in rows:
            bits[(i - rows[0]) // 8] |= 1 << ((i - rows[0]) % 8)
        return {"mark": [mark.index, mark.seek, mark.base, mark.shard], "first": rows[0], "want": bytes(bits)}

    def item(rows: list[int]) -> Item:
        rows.sort()
        runs, run = [], [rows[0]]
        for i in rows[1:]:
            if i - run[-1] > _GAP:  # an actor never reads far for nothing
                runs.append(run)
                run = []
            run.append(i)
        return {"segments": [segment(r) for r in [*runs, run]]}

    grouping = Grouping(todo.index, todo.done)
    items: list[Item] = []
    rows: list[int] = []
    group = -2
    for i, g in grouping.in_groups(todo.indices()):
        if rows and len(rows) >= per_item and (g != group or g < 0 or len(rows) >= 4 * per_item):
            items.append(item(rows))
            rows = []
        rows.append(i)
        group = g
    if rows:
        items.append(item(rows))
    return items


def _absolute(source: Source) -> Source:
    """The source with local paths made absolute: actors do not share the driver's folder."""
    shards = tuple(
        s if is_uri(s.path) else dataclasses.replace(s, path=str(Path(s.path).resolve()))
        for s in source.shards
    )
    base = str(Path(source.base).resolve()) if source.base is not None else None
    return dataclasses.replace(source, shards=shards, base=base)


def wanted_rows(first: int, want: bytes) -> list[int]:
    return [first + i for i in range(len(want) * 8) if want[i // 8] >> (i % 8) & 1]


class RowWorker:
    """A Ray actor: loads the models once, then reads and runs batches of items."""

    def __init__(
        self,
        config: RunConfig,
        source: Source,
        tmp_root: str | None = None,
        generator: GeneratorFactory = Generator,
    ):
        for shard in source.shards:  # a shared folder or a copy: Ray Data's own readers ask the same
            path = Path(shard.path)
            if not is_uri(shard.path) and not (path.is_file() and path.stat().st_size == shard.size):
                raise ConfigError(
                    f"{shard.path}: not the driver's job file on this node; put it where every node reads it"
                )
        work = work_settings(config, source.base)
        self.rows = RowPicker(source, work.columns.id)
        self.tmp = tempfile.mkdtemp(prefix="batchgen-ray-", dir=tmp_root)
        atexit.register(shutil.rmtree, self.tmp, True)  # tmp_root, when the driver gives one, goes too
        self.executor = LocalExecutor(config, work, Path(self.tmp), threading.Event(), generator)
        self.worker = uuid.uuid4().hex

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows: list[RawRow] = []
        for item in batch.to_pylist():
            for seg in item["segments"]:
                rows += self.rows.pick(Mark(*seg["mark"]), wanted_rows(seg["first"], seg["want"]))
        out: dict[str, list] = {name: [] for name in _OUT_SCHEMA.names}
        for finished in self.executor.generate(rows):
            for done in finished:
                out["where"].append(done.where)
                out["id_json"].append(json.dumps(done.result.id))
                out["value"].append(pickle.dumps(done.values))
                values = {**done.result.columns(), "answer_kinds": done.result.answer_kinds}
                for field in RESULT_SCHEMA:
                    out[field.name].append(values[field.name])
        n = len(out["where"])
        out["worker"] = [self.worker] * n
        stats = json.dumps(self.executor.stats().to_json())
        out["stats"] = [stats] * n  # cumulative: the driver keeps the latest
        return pa.table(out, schema=_OUT_SCHEMA)


_RAISED = re.compile(r"^([\w.]+(?:Error|Exception)): (.+)$", re.M)  # a traceback's closing line


def _cause(e: BaseException) -> str:
    """What failed in an actor, from Ray's text of it (its tracebacks, then Ray's own advice):
    the last exception named there that is not Ray's — a batchgen error's message as it is —
    else Ray's last line."""
    text = str(e)
    raised = [(name, message) for name, message in _RAISED.findall(text) if not name.startswith("ray.")]
    if raised:
        name, message = raised[-1]
        return message if name.startswith("batchgen.") else f"{name.rsplit('.', 1)[-1]}: {message}"
    lines = text.strip().splitlines()
    return lines[-1] if lines else type(e).__name__


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
            ray.init(address=config.ray_address, logging_level=logging.WARNING, log_to_driver=False)
        else:
            # More logical CPUs than actors: actors holding every CPU would starve Ray's read task.
            cpus = max(os.cpu_count() or 1, config.workers) + 2
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                _temp_dir=temp_dir,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
    return True


class RayExecutor(Executor):
    """The pending rows in, results out, like LocalExecutor; the rows are read and run in Ray
    actors (the driver loads no model). A set `stop` ends the run between two result batches."""

    def _start(self) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ConfigError("--engine ray needs Ray: pip install 'batchgen[ray]'") from e
        self.make_generator(self.work.generation, self.stop)  # the models inspected, none loaded
        self._latest: dict[str, ExecutorStats] = {}  # each actor's last figures

    def run(self, todo: Pending) -> Batches:
        import ray
        from ray.data import ActorPoolStrategy

        c = self.config
        count = sum(1 for _ in todo.indices())
        if not count:
            return
        # An actor groups rows and overlaps media over a window, but never takes so many that
        # another actor idles: Ray Data coalesces blocks up to the batch size.
        batch_rows = min(c.window, max(c.batch_size, -(-count // (2 * c.workers))))
        per_item = max(1, min(_GAP, batch_rows // 4, -(-count // (2 * c.workers))))  # items for every actor
        items = pending_items(todo, per_item)
        temp_dir = tempfile.mkdtemp(prefix="bg-ray-")  # short: Ray's socket paths must stay short
        started = False
        try:
            started = _start_ray(c, temp_dir)
            ray.data.DataContext.get_current().enable_progress_bars = False  # batchgen's bar counts rows
            logging.getLogger("ray.data").setLevel(logging.WARNING)
            # A block a batch: an actor task's results come back when its block is done, so a
            # block of a quarter of the job would commit nothing until a quarter had run.
            # No more actors than blocks: each loads the model.
            per_batch = max(1, batch_rows // per_item)
            blocks = min(len(items), max(-(-len(items) // per_batch), c.workers))
            ds = ray.data.from_items(items, override_num_blocks=blocks)
            local = started and not c.ray_address  # actors' temp folders inside ours, removed with it
            source = _absolute(todo.index.source)  # type: ignore[arg-type]
            results = ds.map_batches(
                RowWorker,
                fn_constructor_kwargs=dict(
                    config=c,
                    source=source,
                    tmp_root=temp_dir if local else None,
                    generator=self.make_generator,
                ),
                compute=ActorPoolStrategy(size=min(c.workers, blocks)),
                batch_size=per_batch,
                batch_format="pyarrow",
                num_cpus=0.5,  # fractional: leaves room for Ray's own tasks
            )
            try:
                for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
                    if self.stop.is_set():
                        return
                    if out := self._records(batch):
                        yield out
            except ray.exceptions.RayError as e:
                raise RunFailedError(f"the Ray run failed: {short(ValueError(_cause(e)), 300)}") from e
        finally:
            if started:
                ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)

    def _records(self, batch: pa.Table) -> list[Finished]:
        out = []
        for record in batch.to_pylist():
            self._latest[record.pop("worker")] = ExecutorStats.from_json(json.loads(record.pop("stats")))
            values = pickle.loads(record.pop("value"))
            where = record.pop("where")
            record["id"] = json.loads(record.pop("id_json"))
            row = values if isinstance(values, dict) else {}
            out.append(Finished(values=row, where=where, result=Result.from_columns(record)))
        return out

    def stats(self) -> ExecutorStats:
        return ExecutorStats.added(list(self._latest.values()))

    def close(self) -> None:
        pass  # the Ray instance this run started is shut down when its rows are done

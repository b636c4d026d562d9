"""The batches, run one after another on one thread, each through the CLI's `run(config)`.

A batch's life: validating → in_progress → finalizing → completed, or failed (a file that is
not a Batch file, with its errors per line; a run that could not start), expired (its
completion window ended: the finished lines are kept, the others are `batch_expired` in the
error file), cancelling → cancelled (the same, `batch_cancelled`). The model loads with the
first batch and stays for the next (`Resident`). A server started again takes the oldest
unfinished batch first: its finished rows are kept by the run's resume, and a
batch that was cancelling ends cancelled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.errors import BatchgenError, Interrupted
from ..core.settings import RunConfig
from ..core.stop import Stop
from ..execution.config import build_config
from ..execution.runner import run
from ..execution.summary import Progress
from ..generate.generator import Resident
from ..output.openai_batch import batch_lines, error_line
from ..output.parts import partial_dir
from ..output.store import atomic_write
from ..output.tables import concat_tables
from .objects import BatchRecord, FileRecord
from .store import Store

__all__ = ["Queue", "ServeSettings", "window_seconds", "validate_lines"]

log = logging.getLogger("batchgen.serve")

ENDPOINTS = ("/v1/chat/completions",)
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_LISTED_ERRORS = 100  # a bad file's errors listed per line, then a count of the rest


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSettings:
    """What every batch runs with (`batchgen serve`'s flags), and the server's limits."""

    model: str | None = None
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # RunConfig fields (batch_size, …)
    allow_private_urls: bool = False  # the operator's choice: clients' media on loopback/private hosts
    max_file_bytes: int = 200 * 2**20  # OpenAI's own limit for a batch input file
    max_lines: int = 50_000  # requests a batch file may hold (OpenAI's limit)
    max_line_bytes: int = 64 * 2**20  # one request: room for a picture as a data URL, not a flood

    def config(self, job: Path, output: Path, **more: Any) -> RunConfig:
        """A batch's run settings: these, under the server's rules (no local paths in a
        client's rows, the operator's URL policy), and `more` (its time limit)."""
        flags: dict[str, Any] = {**self.overrides, **more, "local_paths": False, "quiet": True}
        if self.model:
            flags["model"] = self.model
        media = {"allow_private_urls": self.allow_private_urls}
        return build_config(job, output, self.preset, media=media, **flags)


def window_seconds(window: str) -> int | None:
    """A completion window (`24h`, also `90m`, `30s`, `2d`) in seconds; None if not one."""
    m = _WINDOW.fullmatch(window)
    if m is None:
        return None
    seconds = int(m.group(1)) * _UNIT[m.group(2)]
    return seconds if seconds <= 7 * 86400 else None


def validate_lines(path: Path, endpoint: str, settings: ServeSettings) -> tuple[int, list[dict[str, Any]]]:
    """A Batch input file's request count and its errors, as the API lists them (`line` from 1):
    each line a JSON object of at most `max_line_bytes` with a string `custom_id` (unique),
    `method` POST, the batch's `url`, an object `body`; at most `max_lines` of them."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0

    def error(code: str, message: str, line: int, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            count += 1
            if count > settings.max_lines:
                error(
                    "too_many_requests", f"a batch file holds at most {settings.max_lines} requests", number
                )
                break
            if len(raw) > settings.max_line_bytes:
                error(
                    "line_too_large", f"a request line holds at most {settings.max_line_bytes} bytes", number
                )
                continue
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):  # a nesting too deep for the parser too
                error("invalid_json_line", "this line is not valid JSON", number)
                continue
            if not isinstance(value, dict):
                error("invalid_request", "a request line must be a JSON object", number)
                continue
            custom_id = value.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                error(
                    "missing_required_parameter", "custom_id must be a non-empty string", number, "custom_id"
                )
            elif custom_id in seen:
                error(
                    "duplicate_custom_id",
                    f"custom_id {custom_id[:64]!r} is used by an earlier line",
                    number,
                    "custom_id",
                )
            else:
                seen.add(custom_id)
            if value.get("method") != "POST":
                error("invalid_method", "method must be POST", number, "method")
            if value.get("url") != endpoint:
                error("mismatched_endpoint", f"url must be the batch's endpoint, {endpoint}", number, "url")
            if not isinstance(value.get("body"), dict):
                error("missing_required_parameter", "body must be a JSON object", number, "body")
    if count == 0:
        error("empty_file", "the file holds no requests", 1)
    return count, errors


class Queue:
    """The one thread that runs batches; `wake()` after a batch is created or cancelled."""

    def __init__(self, store: Store, settings: ServeSettings):
        self.store, self.settings = store, settings
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._running: tuple[str, Stop] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="batchgen-queue", daemon=True)
        self.models = Resident()  # loaded by the first batch, kept for the next

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop between two of the running batch's row batches; it goes on when started again."""
        self._closing.set()
        with self._lock:
            if self._running is not None:
                self._running[1].set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.models.close()

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> BatchRecord | None:
        """validating or in_progress → cancelling (the queue ends it cancelled); None if the
        batch is in another state."""
        record = self.store.update_batch(batch_id, expect=("validating", "in_progress"), status="cancelling")
        if record is not None:
            with self._lock:
                if self._running is not None and self._running[0] == batch_id:
                    self._running[1].set()
            self.wake()
        return record

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closing.is_set():
            batch = self.store.next_batch()
            if batch is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._advance(batch)
            except Exception as e:  # noqa: BLE001 - a batch's failure is its own, never the server's
                log.exception("batch %s failed", batch.id)
                self._fail(batch.id, "server_error", f"{type(e).__name__}: {e}")

    def _advance(self, batch: BatchRecord) -> None:
        """One step of the oldest unfinished batch's life (the loop comes back for the next)."""
        if batch.status == "validating":
            self._validate(batch)
        elif batch.status == "cancelling":
            self._finalize(batch, "cancelled")
        else:  # in_progress, or finalizing when a server stopped during it: the run resumes
            self._run(batch)

    def _validate(self, batch: BatchRecord) -> None:
        folder = self.store.batch_dir(batch.id)
        folder.mkdir(parents=True, exist_ok=True)
        job = folder / "input.jsonl"
        if not job.exists():
            source = self.store.file_path(batch.input_file_id)
            if not source.exists():
                self._fail(batch.id, "invalid_file", f"input file {batch.input_file_id} was deleted")
                return
            _link_or_copy(source, job)
        total, errors = validate_lines(job, batch.endpoint, self.settings)
        if errors:
            listed = errors[:MAX_LISTED_ERRORS]
            if len(errors) > len(listed):
                more = f"{len(errors) - len(listed)} more errors not listed"
                listed.append({"code": "too_many_errors", "message": more, "param": None, "line": None})
            self.store.update_batch(
                batch.id, expect=("validating",), status="failed", errors={"object": "list", "data": listed}
            )
            return
        counts = {"total": total, "completed": 0, "failed": 0}
        self.store.update_batch(batch.id, expect=("validating",), status="in_progress", request_counts=counts)

    def _run(self, batch: BatchRecord) -> None:
        folder = self.store.batch_dir(batch.id)
        left = (batch.expires_at or 0) - time.time()
        ending = "completed"
        if left <= 0:
            ending = "expired"
        else:
            stop = Stop()
            with self._lock:
                self._running = (batch.id, stop)
            current = self.store.batch(batch.id)
            if current is None or current.status == "cancelling":  # cancelled before it was running
                stop.set()
            try:
                config = self.settings.config(
                    folder / "input.jsonl", folder / "output.parquet", time_limit=left
                )
                summary = run(config, self._progress(batch.id), stop, self.models)
                ending = "completed" if summary.complete else "expired"
            except Interrupted:
                if self._closing.is_set():
                    return  # the server stops: the batch goes on when it starts again
                ending = "cancelled"
            except BatchgenError as e:
                self._fail(batch.id, "run_failed", str(e))
                return
            finally:
                with self._lock:
                    self._running = None
        current = self.store.batch(batch.id)
        if current is None or current.status == "cancelling":  # a cancel that came as the run ended
            ending = "cancelled"
        self._finalize(batch, ending)

    def _progress(self, batch_id: str) -> Any:
        def tell(p: Progress) -> None:
            done = p.done_before + p.summary.generated
            failed = p.summary.failed_now
            rate = p.summary.generated / p.elapsed if p.elapsed > 0 else 0.0
            eta = round((p.total - p.summary.generated) / rate, 1) if rate > 0 else None
            record = self.store.batch(batch_id)
            if record is None:
                return
            counts = {**record.request_counts, "completed": done - failed, "failed": failed}
            self.store.update_batch(batch_id, request_counts=counts, eta_s=eta)

        return tell

    # -- the end ------------------------------------------------------------------------
    def _finalize(self, batch: BatchRecord, ending: str) -> None:
        """The output file (the finished requests' responses) and the error file (failed
        requests, and those the batch did not reach, as expired or cancelled), each a stored
        file of purpose batch_output; then the batch's final state and counts."""
        finalizing = {"status": "finalizing"} if ending != "cancelled" else {}
        record = self.store.update_batch(
            batch.id, expect=("in_progress", "finalizing", "cancelling"), **finalizing
        )
        if record is None:
            return
        folder = self.store.batch_dir(batch.id)
        table = _finished(folder / "output.parquet")
        answered, failed, done = [], [], set()
        if table is not None:
            ok = pc.equal(table.column("status"), "ok")
            answered, failed = batch_lines(table.filter(ok)), batch_lines(table.filter(pc.invert(ok)))
            done = set(table.column("id").to_pylist())
        failed += _unreached(folder / "input.jsonl", done, ending)
        counts = {**record.request_counts, "completed": len(answered), "failed": len(failed)}
        self.store.update_batch(
            batch.id,
            status=ending,
            output_file_id=self._stored(batch.id, "output", answered),
            error_file_id=self._stored(batch.id, "error", failed),
            request_counts=counts,
            eta_s=None,
        )

    def _stored(self, batch_id: str, name: str, lines: list[str]) -> str | None:
        """`lines` as a stored file of purpose batch_output; None for no lines."""
        if not lines:
            return None
        file_id = self.store.new_file_id()
        path = self.store.file_path(file_id)
        atomic_write(path, lambda p: p.write_text("".join(lines), encoding="utf-8"))
        size = path.stat().st_size
        record = FileRecord(
            id=file_id,
            bytes=size,
            created_at=int(time.time()),
            filename=f"{batch_id}_{name}.jsonl",
            purpose="batch_output",
            lines=len(lines),
        )
        self.store.add_file(record)
        return file_id

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        data = [{"code": code, "message": message[:2000], "param": None, "line": None}]
        self.store.update_batch(batch_id, status="failed", errors={"object": "list", "data": data})


def _finished(output: Path) -> pa.Table | None:
    """The rows a batch's runs finished: the output's, then its parts' (a stopped run's rows
    wait there for the next run), the last result of an id kept."""
    parts = sorted(Path(partial_dir(output)).glob("part-*.parquet"))
    tables = [pq.read_table(p) for p in ([output] if output.exists() else []) + parts]
    if not tables:
        return None
    table = concat_tables(tables)
    last = {row_id: i for i, row_id in enumerate(table.column("id").to_pylist())}
    return table.take(pa.array(sorted(last.values()), pa.int64()))


_UNREACHED = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def _unreached(job: Path, done: set[Any], ending: str) -> list[str]:
    """Lines for the requests the batch ended before (expired or cancelled)."""
    if ending not in _UNREACHED or not job.exists():
        return []
    code, message = _UNREACHED[ending]
    lines = []
    with open(job, "rb") as f:
        for raw in f:
            try:
                custom_id = json.loads(raw).get("custom_id")
            except (ValueError, RecursionError, AttributeError):
                continue
            if custom_id is not None and custom_id not in done:
                lines.append(error_line(custom_id, code, message))
    return lines


def _link_or_copy(source: Path, target: Path) -> None:
    """The uploaded file as the batch's job, kept as uploaded (a hard link where it can be)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)

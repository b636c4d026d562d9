"""`batchgen serve`'s state: file and batch records in SQLite, file bytes on disk beside it.

Every change is one transaction, so a server killed at any moment and started again finds each
record as it last was. Ids are made here (`file-…`, `batch_…`, random hex) and checked against
their pattern before they name anything on disk: a client's id never becomes a path.
"""

from __future__ import annotations

import fcntl
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError
from .objects import BatchRecord, FileRecord

__all__ = ["Store", "ACTIVE", "ENDED", "FILE_ID", "BATCH_ID"]

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# A batch's states as the API names them: those the queue still has work in, and the ends.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_queue ON batches (status, seq);
"""


class Store:
    """The records in `data/state.sqlite3`, the files' bytes in `data/files/<id>`, and each
    batch's run folder in `data/batches/<id>/`. Safe across threads (one lock, short
    transactions); one server per data folder."""

    def __init__(self, data: Path):
        self.data = data
        self.files_dir, self.batches_dir = data / "files", data / "batches"
        for folder in (self.files_dir, self.batches_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._held = open(data / "server.lock", "a")  # noqa: SIM115 - held while the server lives
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._held.close()
            raise ConfigError(f"another batchgen serve uses {data}") from None
        self._db = sqlite3.connect(data / "state.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._held.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- files -------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise KeyError(file_id)
        return self.files_dir / file_id

    def new_file_id(self) -> str:
        return f"file-{secrets.token_hex(12)}"

    def add_file(self, record: FileRecord) -> None:
        """The record of a file whose bytes are already at `file_path(record.id)`."""
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            db.execute("INSERT INTO files VALUES (?, ?, ?)", (record.id, seq, record.model_dump_json()))

    def file(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRecord.model_validate_json(row[0]) if row else None

    def files(
        self, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Newest first (ties by id), from after the file `after`; and whether more follow."""
        return self._page("files", after, limit, FileRecord, purpose=purpose)

    def delete_file(self, file_id: str) -> bool:
        with self._transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return gone

    # -- batches -----------------------------------------------------------------------
    def new_batch_id(self) -> str:
        return f"batch_{secrets.token_hex(12)}"

    def batch_dir(self, batch_id: str) -> Path:
        if not BATCH_ID.fullmatch(batch_id):
            raise KeyError(batch_id)
        return self.batches_dir / batch_id

    def add_batch(self, record: BatchRecord) -> None:
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?)",
                (record.id, seq, record.status, record.model_dump_json()),
            )

    def batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return BatchRecord.model_validate_json(row[0]) if row else None

    def batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        return self._page("batches", after, limit, BatchRecord)

    def update_batch(
        self, batch_id: str, expect: tuple[str, ...] | None = None, **changes: Any
    ) -> BatchRecord | None:
        """The batch with `changes` applied in one transaction, if its status is one of
        `expect` (None: any); else None and nothing changed. A new status stamps its `<status>_at`."""
        with self._transaction() as db:
            row = db.execute("SELECT record FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            record = BatchRecord.model_validate_json(row[0])
            if expect is not None and record.status not in expect:
                return None
            status = changes.get("status")
            if status is not None and status != record.status and status != "validating":
                changes.setdefault(f"{status}_at", int(time.time()))
            for name, value in changes.items():
                setattr(record, name, value)
            db.execute(
                "UPDATE batches SET status = ?, record = ? WHERE id = ?",
                (record.status, record.model_dump_json(), batch_id),
            )
        return record

    def next_batch(self) -> BatchRecord | None:
        """The oldest batch the queue still has work in (creation order)."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            row = self._db.execute(
                f"SELECT record FROM batches WHERE status IN ({marks}) ORDER BY seq LIMIT 1", ACTIVE
            ).fetchone()
        return BatchRecord.model_validate_json(row[0]) if row else None

    # -- lists -------------------------------------------------------------------------
    def _page(self, table: str, after: str | None, limit: int, kind: Any, purpose: str | None = None) -> Any:
        where, args = [], []
        if after is not None:
            with self._lock:
                found = self._db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
            where.append("seq < ?")
            args.append(found[0] if found else -1)
        query = f"SELECT record FROM {table}"
        if where:
            query += " WHERE " + " AND ".join(where)
        query += " ORDER BY seq DESC"
        if purpose is None:  # a page and one more row say whether more follow
            query += f" LIMIT {int(limit) + 1}"
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        records = [kind.model_validate_json(r[0]) for r in rows]
        if purpose is not None:
            records = [r for r in records if r.purpose == purpose]
        return records[:limit], len(records) > limit

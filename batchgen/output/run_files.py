"""The files a run keeps beside its output: the lock, the heartbeat, the error file.

The lock keeps one run per output. For whoever watches from outside, the heartbeat beside the
lock says who runs, how far it got and how it ended, and the error file lists the failed rows,
one JSON line each (as OpenAI's batches give an `error_file_id`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.errors import ConfigError, OutputLockedError
from ..core.files import file_digest
from ..core.records import ResultRow
from ..core.uris import is_uri
from .stats import read_figures
from .store import Store, is_count, is_measure, json_object, read_small, strict_json

__all__ = [
    "OutputLock",
    "Heartbeat",
    "heartbeat_path",
    "errors_path",
    "stages_folder",
    "stage_output",
    "stage_files",
    "read_heartbeat",
    "failed_records",
    "errors_owned",
    "write_errors",
    "read_lock",
    "lock_held",
    "is_count",
    "stamp",
]

ENDINGS = ("complete", "incomplete", "time-limit", "interrupted", "failed", "crashed")
_STATES = ("running", *ENDINGS)


def stamp(t: float | None = None) -> str:
    """A moment as the files and `status` say it: local time with its offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def heartbeat_path(output: Path | str, sharded: bool = False) -> str:
    return f"{output}/_heartbeat.json" if sharded else f"{output}.heartbeat.json"


def stages_folder(output: Path) -> Path:
    """Where a staged job's stages keep their runs (execution/stages): `OUT.stages/`."""
    return Path(f"{output}.stages")


def stage_output(output: Path, number: int, name: str) -> Path:
    """A stage's own output (its job, settings and stats files are named from it)."""
    return stages_folder(output) / f"{number:02d}-{name}.parquet"


def stage_files(output: Path) -> dict[str, Path]:
    """A staged job's stages that have started (each writes its settings first), by name in
    order: each one's own output, there once the stage has finished a run."""
    found = {}
    for settings in sorted(stages_folder(output).glob("[0-9][0-9]-*.settings.json")):
        stem = settings.name[: -len(".settings.json")]
        found[stem.split("-", 1)[1]] = settings.with_name(f"{stem}.parquet")
    return found


def errors_path(output: Path | str, sharded: bool = False) -> Path | str:
    name = f"{output}/_errors.jsonl" if sharded else f"{output}.errors.jsonl"
    return name if is_uri(str(output)) else Path(name)


@dataclass(slots=True)
class Heartbeat:
    """A run as it goes, rewritten after every batch it commits, and how it ended."""

    pid: int
    host: str
    started: str  # stamp()
    todo: int  # rows this run set out to do
    done_before: int  # rows earlier runs had finished
    done: int = 0  # rows this run has committed
    failed: int = 0  # ... of them failed
    rows_per_s: float = 0.0
    eta_s: float | None = None  # seconds left at that rate, from the last commit
    eta: str | None = None  # ... the moment it would end
    last_commit: str | None = None
    state: str = "running"  # running, or one of ENDINGS
    ended: str | None = None
    message: str | None = None  # how it ended, in words (an error's text)
    time_limit_s: float | None = None

    @classmethod
    def begin(cls, todo: int, done_before: int, time_limit: float | None) -> Heartbeat:
        return cls(os.getpid(), socket.gethostname(), stamp(), todo, done_before, time_limit_s=time_limit)

    def committed(self, done: int, failed: int, elapsed: float) -> None:
        self.done, self.failed = done, failed
        self.rows_per_s = round(done / elapsed, 3) if elapsed > 0 else 0.0
        self.eta_s = round((self.todo - done) / self.rows_per_s, 1) if self.rows_per_s else None
        self.eta = stamp(time.time() + self.eta_s) if self.eta_s is not None else None
        self.last_commit = stamp()

    def end(self, state: str, message: str | None = None) -> None:
        self.state, self.ended, self.message, self.eta_s, self.eta = state, stamp(), message, None, None

    def write(self, store: Store, path: str) -> None:
        store.makedirs(os.path.dirname(path) or ".")  # a folder of shards is made with its first shard
        store.write_text(path, strict_json(asdict(self), indent=2) + "\n")


_SMALL = 64 << 10  # a heartbeat or a lock is a few hundred bytes: a larger one is not ours
_TEXT = 4096  # a heartbeat's longest text (its message is an error's, cut shorter)


def _fits(value: object, hint: object) -> bool:
    """A heartbeat field's value is of its type: an int a count, a float finite, a str short."""
    if value is None:
        return "None" in str(hint)
    kind = str(hint).split(" ")[0]
    if isinstance(value, bool):
        return False
    if kind == "int":
        return is_count(value)
    if kind == "float":
        return is_measure(value)
    return kind == "str" and isinstance(value, str) and len(value) <= _TEXT


def read_heartbeat(store: Store, path: str) -> Heartbeat | None:
    """The heartbeat there, or None (none written, or not one of ours: not a regular file, too
    large, not JSON, or a field of the wrong type or out of range)."""
    value = json_object(store.read_small(path, _SMALL))
    if value is None:
        return None
    hints = {f.name: f.type for f in fields(Heartbeat)}
    known = {k: v for k, v in value.items() if k in hints}
    if not all(_fits(v, hints[k]) for k, v in known.items()) or known.get("state", "running") not in _STATES:
        return None
    try:
        return Heartbeat(**known)
    except TypeError:  # a field it must have is missing
        return None


def lock_held(path: Path) -> bool | None:
    """Whether a process holds the lock file at `path` now, as the kernel says (Linux lists
    every flock in /proc/locks by device and inode): read without touching the lock, so a run
    starting meanwhile is never refused, and never fooled by a pid reused since. None where the
    system does not say."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        with open("/proc/locks", "rb") as f:
            table = f.read(16 << 20).decode(errors="replace")
    except OSError:
        return None
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    return any(line.split()[1:2] == ["FLOCK"] and where in line.split() for line in table.splitlines())


def read_lock(path: Path) -> int | None:
    """The pid a lock names (None: no lock, or not one of ours)."""
    data = read_small(path, _SMALL)
    words = data.decode(errors="replace").split() if data is not None else []
    if len(words) != 1 or not words[0].isdigit() or not 0 < int(words[0]) < 1 << 32:
        return None
    return int(words[0])


def failed_records(rows: list[ResultRow]) -> list[dict[str, Any]]:
    """Each failed row as the error file and `inspect --failed` list it."""
    return [
        {
            "id": r.get("id"),
            "stage": r.get("error_stage"),
            "error": r.get("error"),
            "attempts": r.get("attempts"),
            "transient": bool(r.get("transient")),
        }
        for r in rows
        if r.get("status") != "ok"
    ]


def errors_ours(path: Path, recorded: object) -> bool:
    """Whether the file at `path` is the error file this output's last run wrote, unchanged:
    a regular file whose sha256 is the one its figures recorded (`errors_sha256`)."""
    try:
        return (
            isinstance(recorded, str) and stat.S_ISREG(path.lstat().st_mode) and file_digest(path) == recorded
        )
    except OSError:
        return False


def errors_owned(errors: Path | str, output: Path | str, sharded: bool, stats: Path | str) -> bool:
    """Whether batchgen may write or remove the error file: its name beside the output is
    batchgen's (as the stats file's is); any other path only while nothing is there, or what
    is there is the file this output's last run wrote. (A URI is trusted as given.)"""
    if str(errors) == str(errors_path(output, sharded)) or is_uri(str(errors)):
        return True
    path = Path(errors)
    if not os.path.lexists(path):
        return True
    figures = read_figures(stats)
    return errors_ours(path, figures.errors_sha256 if figures is not None else None)


def write_errors(store: Store, path: str, table: pa.Table, this_run: set[Any]) -> str | None:
    """The output's failed rows, a JSON line each (failed_records, and whether this run failed
    it); the sha256 of what was written, so a later run knows the file for its own (None:
    none failed, and no file, so a stale one never stays). The caller has checked that the
    path is batchgen's to write (errors_owned)."""
    failed = table.filter(pc.not_equal(table.column("status"), "ok"))
    if not failed.num_rows:
        store.remove(path)
        return None
    names = [
        n
        for n in ("id", "status", "error_stage", "error", "attempts", "transient")
        if n in failed.column_names
    ]
    records = failed_records(failed.select(names).to_pylist())
    text = "".join(strict_json({**r, "this_run": r["id"] in this_run}) + "\n" for r in records)
    store.write_text(path, text)
    return hashlib.sha256(text.encode()).hexdigest()


class OutputLock:
    """One run per output: an exclusive `flock` on `<output>.lock`. The kernel drops it when
    the holder dies, so a killed run never blocks the next one. A clean exit removes the
    file; a lock taken on a file that was removed meanwhile is retried on the new one."""

    def __init__(self, output: Path | str):
        if is_uri(str(output)):  # object storage has no locks: one run per output on this machine
            digest = hashlib.sha256(str(output).encode()).hexdigest()[:16]
            self.path = Path(tempfile.gettempdir()) / f"batchgen-{digest}.lock"
        else:
            output = Path(output)
            self.path = output.with_name(output.name + ".lock")
        self._file: IO[str] | None = None

    def __enter__(self) -> OutputLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._take()
        except OSError as e:
            raise ConfigError(f"cannot create the lock {self.path}: {e.strerror or e}") from None

    def _take(self) -> OutputLock:
        while True:
            f = open(self.path, "a+")  # noqa: SIM115 - held for the whole run
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                holder = read_lock(self.path) or "unknown"
                raise OutputLockedError(
                    f"{self.path.name[: -len('.lock')]} is being written by another batchgen run "
                    f"(pid {holder}); its lock is {self.path}"
                ) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()  # the previous holder removed this file as we locked it: take the new one
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)  # still held: nobody can lock it in between
            self._file.close()

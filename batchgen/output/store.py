"""Where outputs are written: a local folder, or object storage through fsspec.

One small interface for the writer (write.py): whole files written so that a reader never
sees half of one (a local temporary file renamed into place; an object, which storage
services make visible only once complete), listings, reads of a few columns, removal.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any, TypeGuard

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError, JobFileError
from ..core.uris import filesystem, is_uri

__all__ = [
    "Store",
    "atomic_write",
    "is_count",
    "is_measure",
    "json_object",
    "read_small",
    "stale_temps",
    "strict_json",
]


def strict_json(value: object, **options: Any) -> str:
    """JSON that every parser reads: a number JSON cannot hold (NaN, ±Infinity) is null."""
    return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_small(path: Path | str, limit: int) -> bytes | None:
    """A small file a run keeps (figures, heartbeat, lock) read as a watcher may: a regular
    file only, opened without following a link or waiting on a FIFO, at most `limit` bytes.
    None: nothing there, not a regular file, or larger than any file of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


_COUNT = 1 << 53  # counts and times past this are forged, not counted


def is_count(value: object) -> TypeGuard[int]:
    """A count as a run writes one: an integer (not a bool) from 0 to 2**53."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _COUNT


def is_measure(value: object) -> TypeGuard[int | float]:
    """A time or a rate as a run writes one: a finite number (not a bool) from 0 to 2**53."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < _COUNT
    )


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """A small file's bytes as the JSON object they hold (None: no bytes, not JSON, not an object)."""
    try:
        value = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


TEMP_PREFIX, TEMP_SUFFIX = ".batchgen-", ".tmp"  # a temporary file's name: short, hidden, ours


def atomic_write(path: Path, write) -> None:
    """`write(p)` fills a file that becomes `path` only once complete. Where the system can,
    it is an unnamed file (O_TMPFILE) named at the end, so even a kill -9 leaves nothing
    half-written behind; elsewhere a short hidden name beside `path`, `.batchgen-<hex>.tmp`
    (a 255-byte name still fits), which `stale_temps` finds after a kill."""
    global _linkable
    tmp = path.with_name(f"{TEMP_PREFIX}{secrets.token_hex(6)}{TEMP_SUFFIX}")
    fd = _unnamed(path.parent) if _linkable is not False else None
    try:
        if fd is not None:
            write(Path(f"/proc/self/fd/{fd}"))
            try:
                os.link(f"/proc/self/fd/{fd}", tmp, follow_symlinks=True)
                _linkable = True
            except OSError:
                if _linkable:
                    raise
                _linkable = False  # this system names no unnamed file (a sandbox's kernel): write it again
                write(tmp)
        else:
            write(tmp)
        os.replace(tmp, path)
    finally:
        if fd is not None:
            os.close(fd)
        tmp.unlink(missing_ok=True)


_linkable: bool | None = None  # whether an unnamed file can be named here (found on the first write)


def _unnamed(folder: Path) -> int | None:
    """A new unnamed file in `folder`, where the system and filesystem have them."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666)
    except OSError:  # a filesystem without them (some network and FUSE ones)
        return None


def stale_temps(folder: Path, age: float = 60.0) -> list[Path]:
    """Temporary files of atomic_write in `folder` left by a killed process (untouched for
    `age` seconds: a live write is never that slow to start)."""
    now = time.time()
    out = []
    try:
        for entry in os.scandir(folder):
            if entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(TEMP_SUFFIX):
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and now - info.st_mtime > age:
                    out.append(Path(entry.path))
    except OSError:
        pass
    return out


class Store:
    """Paths are strings: local ones as the OS spells them, remote ones as URIs."""

    def __init__(self, example: str):
        self.remote = is_uri(example) and not example.startswith("file://")
        self.fs: Any = None
        if self.remote:
            try:
                self.fs, _ = filesystem(example)
            except JobFileError as e:
                raise ConfigError(f"-o {e}") from None
            self._protocol = example.split("://", 1)[0]

    def _uri(self, path: str) -> str:
        return path if is_uri(path) else f"{self._protocol}://{path}"

    def exists(self, path: str) -> bool:
        return self.fs.exists(path) if self.remote else os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return self.fs.isdir(path) if self.remote else os.path.isdir(path)

    def listed(self, folder: str, prefix: str, suffix: str) -> list[str]:
        """Files directly in `folder` named prefix…suffix, sorted."""
        if self.remote:
            try:
                self.fs.invalidate_cache(folder)  # another process may have written since
                names = [self._uri(p) for p in self.fs.ls(folder, detail=False)]
            except FileNotFoundError:
                return []
        else:
            if not os.path.isdir(folder):
                return []
            names = [os.path.join(folder, n) for n in os.listdir(folder)]
        return sorted(p for p in names if p.rsplit("/", 1)[-1].startswith(prefix) and p.endswith(suffix))

    def write_table(self, path: str, table: pa.Table, **options: Any) -> None:
        if self.remote:
            with self.fs.open(path, "wb") as f:
                pq.write_table(table, f, **options)
        else:
            atomic_write(Path(path), lambda p: pq.write_table(table, p, **options))

    def read_table(self, path: str, columns: list[str] | None = None) -> pa.Table:
        if self.remote:
            with self.fs.open(path, "rb") as f:
                return pq.read_table(f, columns=columns)
        return pq.read_table(path, columns=columns)

    def metadata_schema(self, path: str) -> pa.Schema:
        if self.remote:
            with self.fs.open(path, "rb") as f:
                return pq.read_schema(f)
        return pq.read_schema(path)

    def metadata(self, path: str) -> dict[bytes, bytes]:
        if self.remote:
            with self.fs.open(path, "rb") as f:
                return pq.read_schema(f).metadata or {}
        return pq.read_schema(path).metadata or {}

    def write_text(self, path: str, text: str) -> None:
        if self.remote:
            with self.fs.open(path, "w") as f:
                f.write(text)
        else:
            atomic_write(Path(path), lambda p: p.write_text(text))

    def read_text(self, path: str) -> str:
        if self.remote:
            with self.fs.open(path, "r") as f:
                return f.read()
        return Path(path).read_text()

    def read_small(self, path: str, limit: int) -> bytes | None:
        """`read_small` here or in object storage (where a larger object is not read past `limit`)."""
        if not self.remote:
            return read_small(path, limit)
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read(limit + 1)
        except (OSError, ValueError):
            return None
        return data if len(data) <= limit else None

    def makedirs(self, path: str) -> None:
        if not self.remote:  # object storage has no folders to make
            os.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if self.remote:
            if self.fs.exists(path):
                self.fs.rm(path)
        else:
            Path(path).unlink(missing_ok=True)

    def remove_tree(self, path: str) -> None:
        if self.remote:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path, ignore_errors=True)

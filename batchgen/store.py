"""Where outputs are written: a local folder, or object storage through fsspec.

One small interface for the writer (write.py): whole files written so that a reader never
sees half of one (a local temporary file renamed into place; an object, which storage
services make visible only once complete), listings, reads of a few columns, removal.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ConfigError
from .source import is_uri

__all__ = ["Store", "atomic_write"]


def atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Store:
    """Paths are strings: local ones as the OS spells them, remote ones as URIs."""

    def __init__(self, example: str):
        self.remote = is_uri(example) and not example.startswith("file://")
        self.fs: Any = None
        if self.remote:
            try:
                import fsspec

                self.fs, _ = fsspec.core.url_to_fs(example)
            except ImportError as e:
                raise ConfigError(
                    f"-o {example}: writing there needs the filesystem package for its scheme "
                    "(pip install 'batchgen[remote]' for s3://, gs:// and hf://)"
                ) from e
            except Exception as e:  # noqa: BLE001 - an unknown scheme, bad settings
                raise ConfigError(f"-o {example}: cannot use it ({type(e).__name__}: {e})") from e
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

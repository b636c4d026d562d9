"""The parts folder every output layout writes through: numbered Parquet files and a manifest.

  out.parquet.partial/manifest.json             the settings the parts were made with
  out.parquet.partial/part-000001.parquet ...   finished rows (DIR/_partial/ in a shard folder)

A kill loses at most the rows not yet in a part; the next run reads the parts as results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..core.settings import Fingerprint
from ..core.uris import is_uri
from .store import Store

__all__ = ["Earlier", "Parts", "partial_dir", "part_number", "PARTS_KEY", "INPUT_FILE_KEY"]

PARTS_KEY = b"batchgen.parts"  # a shard's metadata: the part numbers it was made of
INPUT_FILE_KEY = b"batchgen.input_file"  # a part's, in a mirrored output: the job file its rows come from


def partial_dir(output: Path | str, sharded: bool = False) -> Path | str:
    """Where parts wait: `out.parquet.partial/`, or `DIR/_partial/` inside a sharded output
    (readers of the folder skip names starting with `_`)."""
    name = f"{output}/_partial" if sharded else f"{output}.partial"
    return name if is_uri(str(output)) else Path(name)


def part_number(path: str) -> int:
    """A part's number, from `part-000042.parquet`."""
    return int(path.rsplit("/", 1)[-1][len("part-") : -len(".parquet")])


@dataclass(slots=True)
class Earlier:
    """What earlier runs left in the output: the files holding their rows (the output or its
    shards, then the parts of an interrupted run) and the settings they were made with."""

    files: list[str]
    settings: Fingerprint | None  # None: nothing earlier says (no earlier rows)
    where: str  # how messages name them


class Parts:
    """The numbered part files of one output and their manifest. The manifest is written with
    the first part (a run that finishes nothing leaves no folder); an interrupted --overwrite
    run's manifest says so, and the next run stays one."""

    def __init__(self, store: Store, folder: Path | str, settings: Fingerprint, overwrite: bool):
        self.store, self.folder = store, folder
        self.manifest: dict[str, Any] = {"settings": settings, "overwrite": overwrite}
        self.last = 0  # the highest part number taken
        self._file_of: dict[str, int] = {}  # a part's job file, read once from its metadata

    @property
    def _manifest_path(self) -> str:
        return f"{self.folder}/manifest.json"

    def files(self) -> list[str]:
        return self.store.listed(str(self.folder), "part-", ".parquet")

    def earlier(self) -> tuple[Fingerprint | None, bool]:
        """The settings an interrupted run's parts were made with (None: no parts folder), and
        whether that run was an --overwrite one."""
        if not self.store.exists(self._manifest_path):
            return None, False
        manifest = json.loads(self.store.read_text(self._manifest_path))
        return manifest.get("settings") or {}, bool(manifest.get("overwrite", False))

    def write(self, table: pa.Table, input_file: int | None = None) -> str:
        """One more part, complete on disk when this returns; `input_file` tags a mirrored
        output's part with the job file its rows come from."""
        if not self.store.exists(self._manifest_path):  # made with the first rows
            self.store.makedirs(str(self.folder))
            self.store.write_text(self._manifest_path, json.dumps(self.manifest, indent=2) + "\n")
        if input_file is not None:
            table = table.replace_schema_metadata({INPUT_FILE_KEY: str(input_file).encode()})
        self.last += 1
        path = f"{self.folder}/part-{self.last:06d}.parquet"
        self.store.write_table(path, table)
        return path

    def input_file(self, part: str) -> int:
        """The job file a mirrored output's part holds rows of (-1: an untagged part)."""
        if part not in self._file_of:
            self._file_of[part] = int(self.store.metadata(part).get(INPUT_FILE_KEY, b"-1"))
        return self._file_of[part]

    def remove(self, parts: list[str]) -> None:
        for part in parts:
            self.store.remove(part)

    def clear(self) -> None:
        """The folder gone, the manifest with it (the output holds the rows now)."""
        self.store.remove_tree(str(self.folder))

"""Where a job's rows live: one file, a folder or glob of shards, or the same on object storage.

A `Source` is the ordered list of a job's files (`Shard`s), all of one format, read as one
job: rows are numbered across shards, and messages name a row by its shard and line. Local
paths are read directly; `s3://`, `gs://`, `hf://` and other fsspec URIs through fsspec,
with credentials from the usual environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN).
"""

from __future__ import annotations

import fnmatch
import glob as globbing
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..core.errors import JobFileError
from ..core.records import ByteCaps
from ..core.uris import checked_location, filesystem, is_uri
from .formats import EXTENSIONS, FORMATS

__all__ = ["Shard", "Source", "resolve", "files_under", "glob_files"]

_NAMES = ", ".join(list(FORMATS)[:-1]) + f" or {list(FORMATS)[-1]}"  # for messages
_FILES = ", ".join(f.extensions[0] for f in FORMATS.values())  # .jsonl, .parquet, .csv, .tar
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True, slots=True)
class Shard:
    path: str  # a local path or a URI
    name: str  # how messages name it: its path under the folder or glob given
    size: int  # bytes: an actor on another node checks it reads the same file


@dataclass(frozen=True, slots=True)
class Source:
    """A job's files in reading order, all of `format`."""

    given: str  # what the user passed: a file, folder, glob or URI
    format: str  # jsonl | parquet | csv | webdataset
    shards: tuple[Shard, ...]
    base: str | None  # where the rows' relative media paths start; None for a remote job
    caps: ByteCaps = ByteCaps()  # no binary cell or tar member over these is read into memory
    video_columns: tuple[str, ...] = ()  # columns mapped to video (--video-column): the video cap
    folder: bool = False  # a folder or glob of shards (an output folder mirrors them), not one file

    @property
    def remote(self) -> bool:
        return is_uri(self.given) and not self.given.startswith("file://")

    def open(self, shard: int) -> BinaryIO:
        """A shard's file, refused when it is no longer the file the run scanned (replaced
        meanwhile): its rows would be read otherwise than the index counted them."""
        path, size = self.shards[shard].path, self.shards[shard].size
        if not is_uri(path):
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
            now = os.fstat(f.fileno()).st_size
            if now != size:
                f.close()
                raise JobFileError(
                    f"changed since the run started ({size:,} bytes then, {now:,} now); "
                    "its rows not yet run are still to do: rerun"
                )
            return f
        try:
            import fsspec

            return fsspec.open(path, "rb").open()
        except Exception as e:  # network, credentials, a missing package: the job cannot be read
            raise JobFileError(f"{path}: cannot open ({type(e).__name__}: {e})") from e

    def local_paths(self) -> list[Path]:
        return [Path(s.path) for s in self.shards if not is_uri(s.path)]


def resolve(given: str | Path, fmt: str | None = None) -> Source:
    """The job's files: a file; every job file in a folder (recursively, hidden ones and `_`
    names skipped, as pyarrow does); the files a glob matches; each as a local path or a URI.
    A folder of WebDataset tars may hold img2dataset's Parquet metadata beside them: the tars
    are the job. Raises JobFileError when nothing is found or formats are mixed."""
    given = checked_location(str(given), "job")
    if fmt is not None and fmt not in FORMATS:
        raise JobFileError(f"unknown --format {fmt!r} (expected {_NAMES})")
    if is_uri(given):
        fs, root = filesystem(given)
        entries = _listed_remote(fs, root, given)
    else:
        entries = _listed_local(given)
    if not entries:
        if _GLOB.search(given):
            raise JobFileError(f"{given}: matches no file")
        if not is_uri(given) and Path(given).is_dir():
            raise JobFileError(f"{given}: no job files in it ({_FILES})")
        if not is_uri(given) and os.path.lexists(given):
            raise JobFileError(f"{given}: not a regular file (a FIFO, a device or a socket); a job is a file")
        raise JobFileError(f"{given}: no such job file")
    single = len(entries) == 1 and entries[0][1] == ""
    if single:
        path, _, size = entries[0]
        kind = fmt or EXTENSIONS.get(Path(path).suffix.lower())
        if kind is None:
            raise JobFileError(
                f"{given}: cannot tell the format from the extension {Path(path).suffix!r}; "
                f"pass --format {_NAMES}"
            )
        return Source(given, kind, (Shard(path, Path(path).name, size),), _base(given, is_dir=False))
    kinds: dict[str, list[tuple[str, str, int]]] = {}
    for path, name, size in entries:
        kind = EXTENSIONS.get(Path(name).suffix.lower())
        if kind is not None and fmt in (None, kind):
            kinds.setdefault(kind, []).append((path, name, size))
    if "webdataset" in kinds and fmt is None:
        kinds = {"webdataset": kinds["webdataset"]}
    if not kinds:
        raise JobFileError(f"{given}: no job files in it ({_FILES})")
    if len(kinds) > 1:
        found = ", ".join(f"{len(v)} {k}" for k, v in sorted(kinds.items()))
        raise JobFileError(f"{given}: shards of several formats ({found}); pass --format to choose one")
    ((kind, shards),) = kinds.items()
    return Source(
        given,
        kind,
        tuple(Shard(p, n, s) for p, n, s in sorted(shards, key=lambda e: e[1])),
        _base(given, is_dir=not _GLOB.search(given)),
        folder=True,
    )


def _base(given: str, is_dir: bool) -> str | None:
    """Relative media paths start at the job file's folder, the folder given, or a glob's fixed folder."""
    if is_uri(given):
        return None
    if _GLOB.search(given):
        return _fixed(given)
    return given if is_dir else str(Path(given).parent)


def _fixed(pattern: str) -> str:
    """The folder a glob's matches lie under: its text before the first wildcard, to the last `/`."""
    wildcard = _GLOB.search(pattern)
    head = pattern[: wildcard.start()] if wildcard else pattern
    return head.rsplit("/", 1)[0] if "/" in head else "."


def _listed_local(given: str) -> list[tuple[str, str, int]]:
    """(path, name under what was given ("" for a single file), size) of each candidate file."""
    path = Path(given)
    if _GLOB.search(given):
        root = Path(_fixed(given))
        matched = sorted(glob_files(given))  # a bounded walk: a symlink loop cannot hang it
        return [
            (str(p), str(p.relative_to(root)) if p.is_relative_to(root) else str(p), p.stat().st_size)
            for p in matched
        ]
    if path.is_dir():
        out = []
        for p in sorted(files_under(path)):
            rel = p.relative_to(path)
            if not any(part.startswith((".", "_")) for part in rel.parts):
                out.append((str(p), str(rel), p.stat().st_size))
        return out
    if path.is_file():
        return [(given, "", path.stat().st_size)]
    return []


def files_under(root: Path) -> Iterator[Path]:
    """Every file below `root`, following symlinked folders but entering each real folder
    once: a link to `.` or to a parent cannot loop the walk."""
    seen: set[tuple[int, int]] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        try:
            st = os.stat(folder)
        except OSError:
            dirs[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            if path.is_file():
                yield path


def glob_files(pattern: str) -> list[Path]:
    """Files matching `pattern` (`*`, `?`, `[...]` within a name, `**` across folders),
    found by the bounded walk from the pattern's fixed leading folders."""
    parts = Path(pattern).expanduser().parts
    fixed = next((i for i, p in enumerate(parts) if globbing.has_magic(p)), len(parts))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    rest = parts[fixed:]
    if not rest:
        return [base] if base.is_file() else []
    if not base.is_dir():
        return []
    return [p for p in files_under(base) if _matches(p.relative_to(base).parts, rest)]


def _matches(names: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Glob's rules: a hidden name (`.x`) only matches a part that starts with a dot, and
    `**` crosses no hidden folder."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        ends = next((i for i, n in enumerate(names) if n.startswith(".")), len(names))
        return any(_matches(names[i:], pattern[1:]) for i in range(ends + 1))
    if not names or (names[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(names[0], pattern[0]) and _matches(names[1:], pattern[1:])


def _listed_remote(fs: Any, root: str, given: str) -> list[tuple[str, str, int]]:
    protocol = given.split("://", 1)[0]

    def uri(path: str) -> str:
        return path if is_uri(path) else f"{protocol}://{path}"

    try:
        if _GLOB.search(root):
            fixed = _fixed(root)
            found = [(p, i) for p, i in sorted(fs.glob(root, detail=True).items()) if i["type"] == "file"]
            return [(uri(p), p[len(fixed) :].lstrip("/"), int(info["size"])) for p, info in found]
        info = fs.info(root)
        if info["type"] == "file":
            return [(given, "", int(info["size"]))]
        found = sorted(fs.find(root, detail=True).items())
        out = []
        for p, info in found:
            rel = p[len(root.rstrip("/")) :].lstrip("/")
            if not any(part.startswith((".", "_")) for part in rel.split("/")):
                out.append((uri(p), rel, int(info["size"])))
        return out
    except FileNotFoundError:
        return []
    except Exception as e:  # noqa: BLE001 - network, credentials
        raise JobFileError(f"{given}: cannot list it ({type(e).__name__}: {e})") from e

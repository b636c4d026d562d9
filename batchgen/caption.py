"""`batchgen caption`: a job file built from folders of images and videos, one row per
file and prompt, with ids from the files' relative paths so reruns resume and pick up new files."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import ConfigError

__all__ = ["IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "find_media", "write_caption_jobs"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v")


def _files_under(root: Path) -> Iterator[Path]:
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


def _glob(pattern: str) -> list[Path]:
    """Files matching `pattern` (`*`, `?`, `[...]` within a name, `**` across folders),
    found by the bounded walk from the pattern's fixed leading folders."""
    parts = Path(pattern).expanduser().parts
    fixed = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    rest = parts[fixed:]
    if not rest:
        return [base] if base.is_file() else []
    if not base.is_dir():
        return []
    return [p for p in _files_under(base) if _matches(p.relative_to(base).parts, rest)]


def _matches(names: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    if not pattern:
        return not names
    if pattern[0] == "**":
        return any(_matches(names[i:], pattern[1:]) for i in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatchcase(names[0], pattern[0]) and _matches(names[1:], pattern[1:])


def find_media(paths: Iterable[str], extensions: Iterable[str]) -> list[tuple[str, Path]]:
    """(relative name, file) for every matching file: folders recursively, globs expanded,
    each file once, in a stable order."""
    wanted = {e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}
    found: dict[Path, str] = {}
    for arg in paths:
        path = Path(arg).expanduser()
        if path.is_dir():
            for file in _files_under(path):
                found.setdefault(file.resolve(), f"{path.name}/{file.relative_to(path).as_posix()}")
        elif path.is_file():
            found.setdefault(path.resolve(), path.name)
        else:
            matches = _glob(arg)
            if not matches:
                raise ConfigError(f"{arg}: no such file, folder or matching glob")
            for match in matches:
                found.setdefault(match.resolve(), match.as_posix())
    return sorted(((name, file) for file, name in found.items() if file.suffix.lower() in wanted))


def write_caption_jobs(
    paths: Iterable[str], prompts: Iterable[str], output: Path, extensions: Iterable[str] | None = None
) -> Path:
    """Write `<output>.jobs.jsonl`: one row per file and prompt, id `name#k` for prompt k."""
    extensions = extensions or IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
    files = find_media(paths, extensions)
    if not files:
        raise ConfigError(f"no files with extensions {', '.join(sorted(extensions))} in {', '.join(paths)}")
    job = output.with_name(output.name + ".jobs.jsonl")
    job.parent.mkdir(parents=True, exist_ok=True)
    videos = {e.lower() for e in VIDEO_EXTENSIONS}
    tmp = job.with_name(job.name + ".tmp")
    with tmp.open("w") as f:
        for name, file in files:
            kind = "video" if file.suffix.lower() in videos else "image"
            ref = os.path.relpath(file, job.parent)  # the job file travels with its folder
            for k, prompt in enumerate(prompts):
                row = {"id": f"{name}#{k}", kind: ref, "file": name}
                if prompt:
                    row["prompt"] = prompt
                f.write(json.dumps(row) + "\n")
    tmp.replace(job)
    return job

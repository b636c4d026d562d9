"""`batchgen caption`: a job built from folders of images and videos, one row per file and prompt."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..core.errors import ConfigError
from ..input.source import files_under, glob_files

__all__ = ["IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "MEDIA_EXTENSIONS", "find_media", "write_caption_jobs"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v")
AUDIO_EXTENSIONS = (".wav", ".mp3", ".flac", ".ogg", ".m4a")
MEDIA_EXTENSIONS = frozenset(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS + AUDIO_EXTENSIONS)  # no caption takes these


def find_media(paths: Iterable[str], extensions: Iterable[str]) -> list[tuple[str, Path]]:
    """(relative name, file) for every matching file: folders recursively, globs expanded,
    each file once (a file linked in twice is one file), in a stable order. The file is the
    path as found, links not followed: a folder linked into the dataset stays where it was
    linked (export writes beside it, never above it)."""
    wanted = {e.lower() if e.startswith(".") else "." + e.lower() for e in extensions}
    found: dict[Path, tuple[str, Path]] = {}
    folders = [Path(arg).expanduser() for arg in paths if Path(arg).expanduser().is_dir()]
    names = {}  # a folder's name in ids: its own name, or more of its path where two share one
    for folder in folders:
        same = [f for f in folders if f.name == folder.name]
        top = Path(os.path.commonpath([str(f.resolve().parent) for f in same]))
        names[folder] = folder.resolve().relative_to(top).as_posix()
    for arg in paths:
        path = Path(arg).expanduser()
        if path.is_dir():
            for file in files_under(path):
                found.setdefault(file.resolve(), (f"{names[path]}/{file.relative_to(path).as_posix()}", file))
        elif path.is_file():
            found.setdefault(path.resolve(), (path.name, path))
        else:
            matches = glob_files(arg)
            if not matches:
                raise ConfigError(f"{arg}: no such file, folder or matching glob")
            for match in matches:
                found.setdefault(match.resolve(), (match.as_posix(), match))
    return sorted((name, file) for real, (name, file) in found.items() if real.suffix.lower() in wanted)


SIDECAR_FIELD = "caption_txt"  # a --prompt-template naming it gets each image's caption file
_SIDECAR_CHARS = 65_536  # a caption is a line or a paragraph: more is no caption file


def _sidecar(file: Path) -> str:
    """The text of the caption file beside `file` (`x.png` → `x.txt`), or "" when there is none."""
    path = file.with_suffix(".txt")
    if not path.is_file():
        return ""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        return f.read(_SIDECAR_CHARS).strip()


def write_caption_jobs(
    paths: Iterable[str],
    prompts: Iterable[str],
    output: Path,
    extensions: Iterable[str] | None = None,
    sidecars: bool = False,
) -> Path:
    """Write `<output>.jobs.jsonl`: one row per file and prompt, id `name#k` for prompt k; with
    `sidecars`, each row also carries its file's caption file as `caption_txt` (only then: a
    caption file written after a run must not change the rows of runs that do not read it)."""
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
            ref = os.path.relpath(os.path.abspath(file), job.parent)  # the job file travels with its folder
            extra = {SIDECAR_FIELD: _sidecar(file)} if sidecars else {}
            for k, prompt in enumerate(prompts):
                row = {"id": f"{name}#{k}", kind: ref, "file": name, **extra}
                if prompt:
                    row["prompt"] = prompt
                f.write(json.dumps(row) + "\n")
    tmp.replace(job)
    return job

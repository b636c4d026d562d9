"""What an export is about: its options, items, the files it may never write over, its summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..core.errors import ConfigError, describe
from ..core.records import ResultRow
from ..input.formats import EXTENSIONS
from ..output.about import About, JobAbout
from ..output.parts import partial_dir
from ..output.stats import stats_path
from .results import MediaPolicy

__all__ = ["ExportOptions", "ExportSummary", "Item", "Origin", "Forbidden", "item_text", "item_fields"]


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """What to write and how; each default carries its reason."""

    format: Literal["txt", "imagefolder", "wide", "jsonl"]
    to: Path | None = None  # txt: mirror under this folder; imagefolder: a new dataset folder
    output: Path | None = None  # wide / jsonl: the file
    caption_extension: str = ".txt"  # kohya's --caption_extension default
    prompt: str | None = None  # one prompt's answers (its number or its text) as `text`
    field: str | None = None  # a structured answer's field as the text (a list joined by ", ": tags)
    join: str | None = None  # every prompt's answers, in prompt order, joined by this
    prefix: str = ""  # trigger words, written as given (include your separator)
    suffix: str = ""
    on_existing: Literal["skip", "overwrite", "append", "prepend"] = "skip"  # a caption file already there
    separator: str = " "  # between an existing caption and the new one (append, prepend)
    caption_name: Literal["stem", "with-extension"] = "stem"  # a.png → a.txt (kohya's), or a.png.txt
    link: Literal["copy", "hard", "symbolic"] = "copy"  # imagefolder --to: a copy the trainer may edit
    changed: Literal["refuse", "keep"] = "refuse"  # a picture replaced since the run: its caption is stale
    stage: str | None = None  # a staged job's output: this stage's answers, of the rows kept to the end


@dataclass(slots=True)
class ExportSummary:
    """What an export wrote and what it left out, for the line the CLI prints."""

    written: int = 0  # caption files, metadata lines or rows
    skipped: int = 0  # caption files already there that batchgen did not write (--on-existing skip)
    current: int = 0  # caption files batchgen wrote that already say what they would now
    failed: int = 0  # media whose chosen answers include a failed row: nothing written for them
    empty: int = 0  # media whose caption is empty: nothing written for them
    missing: int = 0  # media files the results name that are not there (or the run's policy refuses)
    without_media: int = 0  # rows with no image or video (txt, imagefolder leave them out)
    remote: int = 0  # media the run fetched from a URL: no local file to put a caption beside
    as_bytes: int = 0  # txt: pictures held as bytes (a dataset's), no file to put a caption beside
    pictures: int = 0  # imagefolder --to: pictures copied, linked or written out from bytes
    changed: list[str] = field(default_factory=list)  # pictures replaced since the run: not written
    refused: list[str] = field(default_factory=list)  # targets left alone: a FIFO, a link, a device
    errors: list[str] = field(default_factory=list)  # files that could not be written, and why
    where: list[str] = field(default_factory=list)
    note: str = ""  # why nothing could be written, when that is the answer

    @property
    def ok(self) -> bool:
        """Something was written (or batchgen's own file already said it), and no file was left
        alone, refused, stale or broken."""
        wrote = bool(self.written or self.current)
        return wrote and not (self.skipped or self.changed or self.refused or self.errors)


@dataclass(slots=True)
class Item:
    """One media file (or one row without media) and its answers by prompt number."""

    key: str  # how a table row names it: the captioning run's `file`, else the reference or id
    ref: str | None  # the reference as the run read it (None: bytes, or no media)
    source: Literal["file", "bytes", "url", "none"]  # what the run read it from
    path: Path | None = None  # a file's, under the run's policy (None: not there, or refused)
    named: Path | None = None  # ... as the job named it, absolute, links not followed
    digest: str | None = None  # media held as bytes: their sha256
    read: dict[str, Any] | None = None  # a local file as the run read it (a MediaFile's fields)
    ids: list[str] = field(default_factory=list)  # its rows' id keys, and their input hashes
    hashes: list[str | None] = field(default_factory=list)
    answers: dict[int, str | None] = field(default_factory=dict)  # None: that row failed
    fields: dict[int, dict[str, Any]] = field(default_factory=dict)  # a structured answer's fields
    errors: list[str] = field(default_factory=list)
    data: bytes | None = None  # a bytes item's picture, once found


@dataclass(frozen=True, slots=True)
class Origin:
    """Where pictures held as bytes are found again: the results' rows (a kept `jpg`), and
    the job the run read, under its media policy."""

    rows: list[ResultRow]
    about: About
    policy: MediaPolicy


@dataclass(frozen=True, slots=True)
class Forbidden:
    """Files an export must never write over: every media file the results name, the results
    (a file and its stats and parts, or everything in a shard folder) and the job's files (a
    file, or the job-format files in its folder)."""

    media: frozenset[Path]
    results: frozenset[Path]
    results_folder: Path | None
    job: Path | None
    job_folder: Path | None

    @classmethod
    def of(cls, results: Path, items: list[Item], job: JobAbout | None) -> Forbidden:
        results = results.resolve()
        job_path = Path(job.path).resolve() if job is not None and job.path is not None else None
        folder = results.is_dir()
        return cls(
            frozenset(i.path for i in items if i.path is not None),
            frozenset(() if folder else (results, Path(stats_path(results)), Path(partial_dir(results)))),
            results if folder else None,
            job_path,
            job_path if job_path is not None and job_path.is_dir() else None,
        )

    def why(self, target: Path, source: Path | None = None) -> str | None:
        """Why `target` may not be written (None: it may); `source` is the picture whose own
        place it is (a picture copied onto itself is kept, not refused). A name the filesystem
        cannot even look up (too long) is left to its write, which names it and goes on."""
        try:
            resolved = target.resolve()
            if resolved in self.media and resolved != source:
                return "a media file of these results"
            folder = self.results_folder
            if resolved in self.results or folder is not None and resolved.is_relative_to(folder):
                return "part of the results"
            if resolved == self.job or (
                self.job_folder and resolved.is_relative_to(self.job_folder) and resolved.suffix in EXTENSIONS
            ):
                return "part of the job"
            return "a folder" if resolved.is_dir() else None
        except OSError:
            return None

    def check(self, target: Path, what: str) -> None:
        why = self.why(target)
        if why:
            raise ConfigError(f"{what} {describe(str(target))}: is {why}; choose another")


def item_text(item: Item, ks: list[int], options: ExportOptions) -> str | None:
    """An item's caption: its chosen answers joined, between the prefix and the suffix; None
    when one of its rows failed, "" when its answers are empty."""
    found = [item.answers.get(k) for k in ks]
    answers = [a for a in found if a is not None]
    if len(answers) < len(found):
        return None
    if not all(answers):
        return ""
    return options.prefix + (options.join or "").join(answers) + options.suffix


def item_fields(item: Item, fields: dict[str, tuple[int, str]]) -> dict[str, Any]:
    return {out: item.fields.get(k, {}).get(key) for out, (k, key) in fields.items()}

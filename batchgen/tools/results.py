"""A results file read back by `inspect`, `report` and `export`: rows, media policy, job pictures."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import BatchgenError, JobFileError
from ..core.figures import GROUPED_BY
from ..core.files import local_path
from ..core.records import MEDIA_COLUMNS, RESULT_COLUMNS, MediaRef, ResultRow
from ..core.settings import Columns
from ..input.parse import asked
from ..input.read import id_key, iter_rows
from ..input.source import resolve
from ..output.about import About, JobAbout
from ..output.run_files import stage_files
from ..output.tables import RESULT_SCHEMA, stage_names

__all__ = [
    "stage_results",
    "staged",
    "read_results",
    "results_schema",
    "results_about",
    "MediaPolicy",
    "media_policy",
    "cell_refs",
    "media_columns",
    "job_pictures",
    "Ref",
    "Asking",
    "asking",
    "made_by",
]

_NEEDED = ("id", "status", "error", "error_stage")  # every output keeps these (KEPT_COLUMNS)


def read_results(path: Path) -> list[ResultRow]:
    """The rows, with every column of ours (those the output left out: empty, or 0)."""
    table = _table(path)
    for name in RESULT_COLUMNS:
        if name not in table.column_names:
            type_ = RESULT_SCHEMA.field(name).type
            empty = pa.scalar(0 if pa.types.is_integer(type_) or pa.types.is_floating(type_) else None, type_)
            table = table.append_column(pa.field(name, type_), pa.repeat(empty, table.num_rows))
    return table.to_pylist()


def stage_results(path: Path, stage: str | None) -> tuple[Path, set[Any] | None]:
    """The results to read: `path` itself, or for a staged job's output (`--stage NAME`) that
    stage's own results with the ids of the rows that went through every stage (the kept ones:
    `dropped_at` null)."""
    try:
        pq.read_schema(path)
    except (OSError, ValueError) as e:
        raise JobFileError(f"{path}: not a batchgen results file ({e})") from e
    found = staged(path)
    if not found:
        if stage is not None:
            raise JobFileError(f"{path}: --stage {stage!r:.40}, but these are a one-stage run's results")
        return path, None
    if stage not in found:
        raise JobFileError(
            f"{path}: a staged job's output: give --stage, one of {', '.join(found) or 'none'}"
        )
    table = pq.read_table(path, columns=["id", "dropped_at"])
    ids, dropped = table.column("id").to_pylist(), table.column("dropped_at").to_pylist()
    kept = {i for i, d in zip(ids, dropped, strict=True) if d is None}
    return found[stage], kept


def staged(path: Path) -> dict[str, Path]:
    """A staged job's output's stages (those its columns name) and each one's own results
    file, by name in order; none for a one-stage run's results or a shard folder."""
    if path.is_dir():
        return {}
    try:
        names = stage_names(pq.read_schema(path).names)
    except (OSError, ValueError):
        return {}
    files = stage_files(path)
    return {name: files[name] for name in names if name in files and files[name].is_file()}


def _table(path: Path):
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise JobFileError(f"{path}: not a batchgen results file ({e})") from e
    missing = [c for c in _NEEDED if c not in table.column_names]
    if missing:
        raise JobFileError(
            f"{path}: not a batchgen results file (no {', '.join(missing)} column); "
            "give the output of `batchgen run`"
        )
    return table


def results_schema(path: Path) -> pa.Schema:
    """The output's columns and metadata (a shard folder: its first shard's)."""
    files = [path]
    if path.is_dir():  # its shards, named `part-000001` or as the job's files; `_partial/` is not one
        shards = (
            p for p in path.rglob("*.parquet") if not p.relative_to(path).as_posix().startswith(("_", "."))
        )
        files = sorted(shards)
    return pq.read_schema(files[0]) if files else pa.schema([])


def results_about(path: Path) -> About:
    return About.of(results_schema(path).metadata)


Ref = str | bytes  # a path, URL or data URL; or an image's bytes


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Which local media a tool may open: those the run could read (output metadata)."""

    base: Path | None  # where relative paths start; None: no local path at all (a remote job)
    root: Path | None = None  # --media-root: nothing outside it

    def path(self, ref: str) -> Path | None:
        """The regular file a reference names, if the run's policy let it be read."""
        if self.base is None:
            return None
        try:
            path = local_path(ref, self.base).resolve()
            if self.root is not None and not path.is_relative_to(self.root):
                return None
            return path if path.is_file() else None  # never a FIFO or a device: opening one blocks
        except (OSError, ValueError, RuntimeError):  # NUL bytes, ~nosuchuser, symlink loops
            return None

    def named(self, ref: str) -> Path | None:
        """The file a reference names as the job named it: absolute, `..` folded, links not
        followed (so a folder linked into the dataset stays where it was linked)."""
        if self.base is None:
            return None
        try:
            return Path(os.path.normpath(os.path.abspath(local_path(ref, self.base))))
        except (OSError, ValueError, RuntimeError):
            return None


def media_policy(path: Path, about: About, media_base: Path | None = None) -> MediaPolicy:
    """The run's media policy as its output recorded it (outputs of earlier versions: paths
    start beside the output); `media_base` moves where relative paths start."""
    media = about.media
    root = Path(media.media_root) if media is not None and media.media_root else None
    if media is not None and not media.local_paths and media_base is None:
        return MediaPolicy(None, root)
    base = about.media_base
    return MediaPolicy(media_base or (Path(base) if base else path.parent if path.is_file() else path), root)


def cell_refs(value: object) -> list[Ref]:
    """What a media cell holds: a reference, bytes, a Hugging Face image ({bytes, path}), or a
    list (or JSON text of a list) of those."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    out: list[Ref] = []
    for ref in value if isinstance(value, list) else [value] if value else []:
        if isinstance(ref, dict):
            ref = ref.get("bytes") or ref.get("path")
        if isinstance(ref, (str, bytes)) and ref:
            out.append(ref)
    return out


@dataclass(frozen=True, slots=True)
class Asking:
    """How the run read its rows' questions: its --prompt-template and column mapping, as it
    recorded them (with a report's extra image columns)."""

    template: str | None
    columns: Columns
    cells: frozenset[str]  # the columns parse reads as lists or objects: messages and media

    def of(self, row: ResultRow) -> tuple[str, list[MediaRef]]:
        """What a result row asked (its text, its media in prompt order), read by input/parse as
        the run read it; carried cells kept as JSON text (a list whose types clashed) read back."""
        value = {k: _json(v) if k in self.cells else v for k, v in row.items()}
        return asked(value, self.template, self.columns)


def asking(about: About, extra: tuple[str, ...] = ()) -> Asking:
    """The run's way of reading questions, from the output's metadata; `extra` image columns
    are read beside the run's own."""
    job = about.job or JobAbout()
    image = job.image or (("image", "images") if extra else ())
    columns = Columns(prompt=job.prompt, system=job.system, image=(*image, *extra), video=job.video)
    cells = frozenset(("messages", *MEDIA_COLUMNS, *columns.image, *columns.video))
    return Asking(about.template, columns, cells)


def _json(value: object) -> object:
    """A cell the writer kept as JSON text, as it was; any other value as it is."""
    if isinstance(value, str) and value.startswith(("[", "{")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    return value


def media_columns(about: About, extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(column, kind) where a row's media may be: batchgen's names, the run's --image-column /
    --video-column (recorded in the output) and any `extra` image columns."""
    job = about.job or JobAbout()
    columns = [("image", "image"), ("images", "image"), ("video", "video"), ("videos", "video")]
    columns += [(c, "image") for c in job.image]
    columns += [(c, "video") for c in job.video]
    columns += [(c, "image") for c in extra]
    return list(dict.fromkeys(columns))


def job_pictures(
    about: About,
    wanted: dict[str, str | None],
    columns: list[tuple[str, str]],
    policy: MediaPolicy,
    most: int,
) -> dict[str, list[bytes]]:
    """Pictures the output does not carry (a dataset's image bytes: an img2dataset shard's
    `jpg`), read again from the local job the run read: by id key, the image bytes of each
    row in `wanted` whose input is still what the run read (its fingerprint is the result's
    `input_hash`): a job changed since shows that row nothing. Reading stops once every row
    is found or `most` pictures are read."""
    job = about.job or JobAbout()
    path = job.path
    if not wanted or policy.base is None or path is None or not Path(path).exists():
        return {}
    # only columns the output did not carry: a text job's rows are never read again for nothing
    images = [c for c, kind in columns if kind == "image" and c in job.not_carried]
    if not images:
        return {}
    found: dict[str, list[bytes]] = {}
    read = 0
    try:
        for raw in iter_rows(resolve(path, job.format), id_column=job.id_column):
            key = id_key(raw.id)
            if key not in wanted or key in found or not isinstance(raw.value, dict):
                continue
            if wanted[key] is not None and raw.digest != wanted[key]:
                found[key] = []  # replaced since the run: not the picture its answer is about
                continue
            found[key] = [r for c in images for r in cell_refs(raw.value.get(c)) if isinstance(r, bytes)]
            read += len(found[key])
            if len(found) == len(wanted) or read >= most:
                break
    except (BatchgenError, OSError):  # the job moved or changed since the run
        pass
    return found


def made_by(rows: list[ResultRow]) -> dict[str, list[str]]:
    """What tells the rows of a run of several models or adapters apart: each such column
    (model, adapter) and each row's value, shortened to its folder's name ("base": none)."""
    out = {}
    for column in GROUPED_BY:
        values = [r.get(column) for r in rows]
        if len(set(values)) > 1:
            out[column] = [Path(v).name if isinstance(v, str) else "base" for v in values]
    return out

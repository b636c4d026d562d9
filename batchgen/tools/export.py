"""`batchgen export`: a results file in the shapes training tools read — a caption file beside
each image (kohya sd-scripts, taggui, OneTrainer), an `imagefolder` dataset's `metadata.jsonl`
(Hugging Face datasets, invoke-training), or one row per image with a column per prompt.

A results file holds one row per (media file, prompt); export groups them by the media file
the run read (relative paths start where the run recorded the job's, as `report` does) and
names each prompt by its order of first appearance: `text` when there is one, else `text_0`,
`text_1`, …, or one of them (`prompt`) or all joined (`join`) as `text`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError
from ..output.store import atomic_write
from ..output.tables import ANSWER_PREFIX
from ..output.write import MEDIA_BASE_KEY
from .results import read_results, results_schema

__all__ = ["ExportOptions", "ExportSummary", "export"]

FORMATS = ("txt", "imagefolder", "wide", "jsonl")
_MEDIA = ("image", "video")  # the flat columns whose file a caption belongs to


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


@dataclass(slots=True)
class ExportSummary:
    """What an export wrote and what it left out, for the line the CLI prints."""

    written: int = 0  # caption files, metadata lines or rows
    skipped: int = 0  # caption files already there (--on-existing skip)
    failed: int = 0  # media whose chosen answers include a failed row: nothing written for them
    missing: int = 0  # media files the results name that are not there (txt, imagefolder)
    without_media: int = 0  # rows with no image or video (txt, imagefolder leave them out)
    where: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Item:
    """One media file (or one row without media) and its answers by prompt number."""

    key: str
    ref: str | None
    path: Path | None
    answers: dict[int, str | None] = field(default_factory=dict)  # None: that row failed
    fields: dict[int, dict[str, Any]] = field(default_factory=dict)  # a structured answer's fields
    errors: list[str] = field(default_factory=list)


def export(results: Path, options: ExportOptions) -> ExportSummary:
    rows = read_results(results)
    schema = results_schema(results)
    about = schema.metadata or {}
    base = Path(about[MEDIA_BASE_KEY].decode()) if MEDIA_BASE_KEY in about else results.parent
    types = {
        n[len(ANSWER_PREFIX) :]: schema.field(n).type for n in schema.names if n.startswith(ANSWER_PREFIX)
    }
    if options.field is not None and options.field not in types:
        have = ", ".join(types) or "none: no row had an object JSON schema"
        raise ConfigError(f"--field {options.field!r:.60}: no such answer field (the results have {have})")
    items, prompts = _grouped(rows, base, options.field, list(types))
    columns = _columns(prompts, options)
    fields = _field_columns(columns, list(types))
    summary = ExportSummary()
    if options.format == "txt":
        _write_txt(items, columns, options, summary)
    elif options.format == "imagefolder":
        _write_imagefolder(items, columns, fields, options, summary)
    else:
        _write_table(
            items, columns, {out: types[key] for out, (_, key) in fields.items()}, fields, options, summary
        )
    return summary


def _as_text(value: Any) -> str | None:
    """A field's value as caption text: a list of tags joined by ", " (kohya's tag format)."""
    if value is None:
        return None
    if isinstance(value, list):
        return ", ".join(v if isinstance(v, str) else json.dumps(v) for v in value)
    return value.strip() if isinstance(value, str) else json.dumps(value)


def _grouped(
    rows: list[dict[str, Any]], base: Path, chosen: str | None, fields: list[str]
) -> tuple[list[_Item], list[str]]:
    prompts: list[str] = []
    items: dict[str, _Item] = {}
    for r in rows:
        prompt = str(r.get("prompt") or "")
        if prompt not in prompts:
            prompts.append(prompt)
        ref = next((r[c] for c in _MEDIA if isinstance(r.get(c), str) and r[c]), None)
        if ref is None:
            item = items.setdefault(f"row:{r['id']}", _Item(str(r["id"]), None, None))
        else:
            path = (Path(ref) if Path(ref).is_absolute() else base / ref).resolve()
            item = items.setdefault(f"file:{path}", _Item(str(r.get("file") or ref), ref, path))
        ok, k = r["status"] == "ok", prompts.index(prompt)
        item.answers[k] = (r["generated_text"] or "").strip() if ok else None
        if ok and chosen is not None:  # a row whose answer lacks the field gives no caption
            item.answers[k] = _as_text(r[ANSWER_PREFIX + chosen])
        item.fields[k] = {f: r[ANSWER_PREFIX + f] for f in fields} if ok else {}
        if not ok:
            item.errors.append(f"{r.get('error_stage')}: {r.get('error')}")
    return list(items.values()), prompts


def _columns(prompts: list[str], options: ExportOptions) -> dict[str, list[int]]:
    """Output column → the prompt numbers whose answers make it."""
    if options.prompt is not None:
        chosen = options.prompt
        k = int(chosen) if chosen.isdigit() and int(chosen) < len(prompts) else None
        if k is None and chosen in prompts:
            k = prompts.index(chosen)
        if k is None:
            shown = "; ".join(f"{i}: {p!r:.60}" for i, p in enumerate(prompts))
            raise ConfigError(f"--prompt {chosen!r:.60}: no such prompt (the results have {shown})")
        return {"text": [k]}
    if options.join is not None or len(prompts) == 1:
        return {"text": list(range(len(prompts)))}
    return {f"text_{k}": [k] for k in range(len(prompts))}


def _text(item: _Item, ks: list[int], options: ExportOptions) -> str | None:
    answers = [item.answers.get(k) for k in ks]
    if any(a is None for a in answers):
        return None
    return options.prefix + (options.join or "").join(answers) + options.suffix  # type: ignore[arg-type]


_TAKEN = ("file", "file_name", "media", "text", "status", "error")  # names export's own columns have


def _field_columns(columns: dict[str, list[int]], fields: list[str]) -> dict[str, tuple[int, str]]:
    """A structured answer's fields as columns of their own, each → (prompt number, field):
    `caption`, `tags` for one prompt's answers, `text_0.caption` when several prompts each
    make a column (a join of several has none)."""
    out: dict[str, tuple[int, str]] = {}
    for name, ks in columns.items():
        for key in fields if len(ks) == 1 else []:
            out[key if len(columns) == 1 and key not in _TAKEN else f"{name}.{key}"] = (ks[0], key)
    return out


def _fields(item: _Item, fields: dict[str, tuple[int, str]]) -> dict[str, Any]:
    return {out: item.fields.get(k, {}).get(key) for out, (k, key) in fields.items()}


def _common_root(items: list[_Item]) -> Path:
    paths = [str(i.path.parent) for i in items if i.path is not None]
    return Path(os.path.commonpath(paths)) if paths else Path(".")


def _inside(root: Path, rel: Path) -> Path:
    target = (root / rel).resolve()
    if not target.is_relative_to(root.resolve()):  # a results file naming `../..`: never outside
        raise ConfigError(f"{rel}: would be written outside {root}")
    return target


def _write_txt(items: list[_Item], columns: dict[str, list[int]], options: ExportOptions,
               summary: ExportSummary) -> None:  # fmt: skip
    if len(columns) != 1:
        raise ConfigError(
            "a caption file holds one text: pick a prompt (--prompt K) or join them (--join ' ')"
        )
    (ks,) = columns.values()
    root = _common_root(items)
    for item in items:
        if item.path is None:
            summary.without_media += 1
            continue
        if not item.path.is_file():
            summary.missing += 1
            continue
        text = _text(item, ks, options)
        if text is None:
            summary.failed += 1
            continue
        target = item.path.with_suffix(options.caption_extension)
        if options.to is not None:
            target = _inside(options.to, target.relative_to(root))
        if target.exists():
            if options.on_existing == "skip":
                summary.skipped += 1
                continue
            if options.on_existing == "append":
                text = target.read_text().rstrip("\n") + options.separator + text
            elif options.on_existing == "prepend":
                text = text + options.separator + target.read_text().strip("\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, lambda p, text=text: p.write_text(text + "\n"))
        summary.written += 1
    summary.where = [str(options.to or root)]


def _write_imagefolder(items: list[_Item], columns: dict[str, list[int]], fields: dict[str, tuple[int, str]],
                       options: ExportOptions, summary: ExportSummary) -> None:  # fmt: skip
    media = [i for i in items if i.path is not None]
    summary.without_media = len(items) - len(media)
    root = _common_root(media)
    folder = options.to or root
    lines = []
    for item in media:
        if not item.path.is_file():  # type: ignore[union-attr]
            summary.missing += 1
            continue
        texts = {name: _text(item, ks, options) for name, ks in columns.items()}
        if any(t is None for t in texts.values()):  # a failed row (a broken image): left out
            summary.failed += 1
            continue
        rel = item.path.relative_to(root)  # type: ignore[union-attr]
        if options.to is not None:
            target = _inside(folder, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                try:
                    os.link(item.path, target)  # type: ignore[arg-type]
                except OSError:  # another filesystem: a copy
                    shutil.copy2(item.path, target)  # type: ignore[arg-type]
        record = {"file_name": rel.as_posix(), **texts, **_fields(item, fields)}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        summary.written += 1
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "metadata.jsonl", lambda p: p.write_text("".join(lines)))
    summary.where = [str(folder / "metadata.jsonl")]


def _write_table(items: list[_Item], columns: dict[str, list[int]], types: dict[str, pa.DataType],
                 fields: dict[str, tuple[int, str]], options: ExportOptions,
                 summary: ExportSummary) -> None:  # fmt: skip
    if options.output is None:
        raise ConfigError(f"--format {options.format} writes a file: give -o FILE")
    records = []
    for item in items:
        texts = {name: _text(item, ks, options) for name, ks in columns.items()}
        failed = bool(item.errors)
        summary.failed += failed
        records.append({"file": item.key, "media": item.ref, **texts, **_fields(item, fields),
                        "status": "error" if failed else "ok",
                        "error": item.errors[0] if item.errors else None})  # fmt: skip
    summary.written = len(records)
    out = options.output
    out.parent.mkdir(parents=True, exist_ok=True)
    if options.format == "wide":
        names = ["file", "media", *columns, *fields, "status", "error"]
        table = pa.Table.from_pylist(records, pa.schema([(n, types.get(n, pa.string())) for n in names]))
        atomic_write(out, lambda p: pq.write_table(table, p))
    else:
        atomic_write(
            out, lambda p: p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        )
    summary.where = [str(out)]

"""`batchgen export`: a results file in the shapes training tools read.

A caption file beside each image (kohya sd-scripts, taggui, OneTrainer), an `imagefolder`
dataset's `metadata.jsonl` (Hugging Face datasets, invoke-training), or one row per image with a
column per prompt.

A results file holds one row per (media file, prompt); export groups them by the media file
the run itself read (its `media_files`, never a carried data column), opened under the run's
recorded media policy as `report` does, and names each prompt by its order of first
appearance: `text` when there is one, else `text_0`, `text_1`, …, or one of them (`prompt`)
or all joined (`join`) as `text`. What it writes is decided and checked before the first
file is written (export_items.py holds the records, export_files.py writes the caption
files, export_imagefolder.py an imagefolder).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError, describe
from ..core.records import MediaRef, ResultRow
from ..input.read import id_key
from ..output.about import About
from ..output.resume import replaced
from ..output.store import atomic_write, strict_json
from ..output.tables import ANSWER_PREFIX
from .caption import MEDIA_EXTENSIONS
from .export_files import write_txt
from .export_imagefolder import write_imagefolder
from .export_items import ExportOptions, ExportSummary, Forbidden, Item, Origin, item_fields, item_text
from .results import MediaPolicy, asking, media_policy, read_results, results_schema, stage_results

__all__ = ["FORMATS", "ExportOptions", "ExportSummary", "export"]

FORMATS = ("txt", "imagefolder", "wide", "jsonl")
_CAPTIONED = ("image", "video")  # the kinds of media a caption belongs to


def export(results: Path, options: ExportOptions) -> ExportSummary:
    """Write the results' answers as `options` say; a usage problem, or a target that would
    replace a media file, the results or a file batchgen did not write, is a ConfigError before
    anything is written."""
    _check_options(options)
    results, kept = stage_results(results, options.stage)
    rows = read_results(results)
    if kept is not None:  # a staged job's: the rows its keep_if rules kept
        rows = [r for r in rows if r["id"] in kept]
    schema = results_schema(results)
    about = About.of(schema.metadata)
    policy = media_policy(results, about)
    types = {
        n[len(ANSWER_PREFIX) :]: schema.field(n).type for n in schema.names if n.startswith(ANSWER_PREFIX)
    }
    if options.field is not None and options.field not in types:
        have = ", ".join(types) or "none: no row had an object JSON schema"
        raise ConfigError(f"--field {options.field!r:.60}: no such answer field (the results have {have})")
    recorded = "media_files" in schema.names
    items, prompts = _grouped(rows, policy, options.field, list(types), recorded, about)
    columns = _columns(prompts, options)
    fields = _field_columns(columns, list(types))
    if options.format in ("txt", "imagefolder") and options.field is None:
        _check_plain(rows, types)
    forbidden = Forbidden.of(results, items, about.job)
    summary = ExportSummary()
    items = _unchanged(items, options, summary)
    if options.format == "txt":
        write_txt(items, columns, options, summary, forbidden)
    elif options.format == "imagefolder":
        write_imagefolder(items, columns, fields, options, summary, forbidden, Origin(rows, about, policy))
    else:
        if options.output is not None:
            forbidden.check(options.output, "-o")
        _write_table(
            items, columns, {out: types[key] for out, (_, key) in fields.items()}, fields, options, summary
        )
    return summary


def _unchanged(items: list[Item], options: ExportOptions, summary: ExportSummary) -> list[Item]:
    """The items whose picture is still the one the run read: a picture replaced since (a
    re-crop) would get the old picture's caption, so it is left out and named, unless
    `--changed keep`. Results of versions that recorded no mtime are not checked."""
    if options.changed == "keep":
        return items
    kept = []
    for item in items:
        read = item.read
        if item.path is not None and read is not None and read.get("mtime_ns") is not None:
            if replaced(item.path, read):
                summary.changed.append(describe(item.key))
                continue
        kept.append(item)
    return kept


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _check_options(options: ExportOptions) -> None:
    """Usage problems, one line each (exit 2), before anything is read or written."""
    ext = options.caption_extension
    if not ext.startswith(".") or len(ext) < 2 or ".." in ext or not set(ext) <= _NAME_CHARS or len(ext) > 16:
        raise ConfigError(
            f"--caption-extension {ext!r:.40}: give a file extension such as .txt or .caption "
            "(a dot, then letters, digits, _ or -)"
        )
    if ext.lower() in MEDIA_EXTENSIONS or ext.lower() in (".parquet", ".pq", ".tar"):
        raise ConfigError(
            f"--caption-extension {ext}: a media or results extension; the caption files "
            "would replace pictures or data (use .txt or .caption)"
        )


def _check_plain(rows: list[ResultRow], types: dict[str, pa.DataType]) -> None:
    """A caption is text: a structured answer's JSON object is none, so one of its fields is chosen."""
    if any(r["status"] == "ok" and r.get("parsed") is not None for r in rows):
        have = ", ".join(types) if types else "none typed; `--format jsonl` keeps the JSON"
        raise ConfigError(
            f"the answers are JSON (a JSON-schema run): choose the caption with --field F (the results "
            f"have {have})"
        )


def _as_text(value: object) -> str | None:
    """A field's value as caption text: a list of tags joined by ", " (kohya's tag format)."""
    if value is None:
        return None
    if isinstance(value, list):
        return ", ".join(v if isinstance(v, str) else json.dumps(v) for v in value)
    return value.strip() if isinstance(value, str) else json.dumps(value)


def _media_of(row: ResultRow, recorded: bool, asked: list[MediaRef]) -> dict[str, Any] | None:
    """The first image or video the run read for this row, as a MediaFile's fields. Outputs of
    versions that recorded none: the first the row asked about."""
    if recorded:
        return next((f for f in row.get("media_files") or [] if f["kind"] in _CAPTIONED), None)
    ref = next((m.source for m in asked if m.kind in _CAPTIONED), None)
    if isinstance(ref, bytes):
        return {"ref": None, "sha256": hashlib.sha256(ref).hexdigest()}
    return {"ref": ref, "sha256": None} if ref is not None else None


def _grouped(
    rows: list[ResultRow],
    policy: MediaPolicy,
    chosen: str | None,
    fields: list[str],
    recorded: bool,
    about: About,
) -> tuple[list[Item], list[str]]:
    prompts: dict[str, int] = {}  # each prompt's number, in the order rows first ask it
    items: dict[str, Item] = {}
    reader = asking(about)
    for r in rows:
        question, asked = reader.of(r)
        prompt = reader.template if reader.template is not None else question  # a template: one prompt
        k = prompts.setdefault(prompt, len(prompts))
        media = _media_of(r, recorded, asked)
        ref = media["ref"] if media else None
        name = str(r.get("file") or ref or r["id"])
        if media is None:
            item = items.setdefault(f"row:{r['id']}", Item(str(r["id"]), None, "none"))
        elif ref is None:
            digest = media["sha256"]
            item = items.setdefault(f"bytes:{digest or r['id']}", Item(name, None, "bytes", digest=digest))
        elif ref.startswith(("http://", "https://")):
            item = items.setdefault(f"url:{ref}", Item(name, ref, "url"))
        else:
            path = policy.path(ref)
            found = Item(name, ref, "file", path, policy.named(ref), read=media if recorded else None)
            item = items.setdefault(f"file:{path}" if path else f"ref:{ref}", found)
        item.ids.append(id_key(r["id"]))
        item.hashes.append(r.get("input_hash"))
        ok = r["status"] == "ok"
        item.answers[k] = (r["generated_text"] or "").strip() if ok else None
        if ok and chosen is not None:  # a row whose answer lacks the field gives no caption
            item.answers[k] = _as_text(r[ANSWER_PREFIX + chosen])
        item.fields[k] = {f: r[ANSWER_PREFIX + f] for f in fields} if ok else {}
        if not ok:
            item.errors.append(f"{r.get('error_stage')}: {r.get('error')}")
    return list(items.values()), list(prompts)


def _columns(prompts: list[str], options: ExportOptions) -> dict[str, list[int]]:
    """Output column → the prompt numbers whose answers make it."""
    if options.prompt is not None:
        chosen = options.prompt
        k = int(chosen) if chosen.isdigit() and int(chosen) < len(prompts) else None
        if k is None and chosen in prompts:
            k = prompts.index(chosen)
        if k is None:
            shown = "; ".join(f"{i}: {p!r:.60}" for i, p in enumerate(prompts[:10]))
            raise ConfigError(f"--prompt {chosen!r:.60}: no such prompt (the results have {shown})")
        return {"text": [k]}
    if options.join is not None or len(prompts) == 1:
        return {"text": list(range(len(prompts)))}
    return {f"text_{k}": [k] for k in range(len(prompts))}


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


def _write_table(
    items: list[Item],
    columns: dict[str, list[int]],
    types: dict[str, pa.DataType],
    fields: dict[str, tuple[int, str]],
    options: ExportOptions,
    summary: ExportSummary,
) -> None:
    if options.output is None:
        raise ConfigError(f"--format {options.format} writes a file: give -o FILE")
    records = []
    for item in items:
        texts = {name: item_text(item, ks, options) for name, ks in columns.items()}
        failed = bool(item.errors)
        summary.failed += failed
        records.append(
            {
                "file": item.key,
                "media": item.ref,
                **texts,
                **item_fields(item, fields),
                "status": "error" if failed else "ok",
                "error": item.errors[0] if item.errors else None,
            }
        )
    summary.written = len(records)
    out = options.output
    out.parent.mkdir(parents=True, exist_ok=True)
    if options.format == "wide":
        names = ["file", "media", *columns, *fields, "status", "error"]
        table = pa.Table.from_pylist(records, pa.schema([(n, types.get(n, pa.string())) for n in names]))
        atomic_write(out, lambda p: pq.write_table(table, p))
    else:
        lines = "".join(strict_json(r, ensure_ascii=False) + "\n" for r in records)
        atomic_write(out, lambda p: p.write_text(lines))
    summary.where = [str(out)]

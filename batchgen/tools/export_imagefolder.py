"""`export --format imagefolder`: a Hugging Face imagefolder's `metadata.jsonl`, or a new dataset."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from ..core.errors import ConfigError, describe, short
from ..core.files import file_digest
from ..input.read import id_key
from ..output.store import TEMP_PREFIX, TEMP_SUFFIX, atomic_write, strict_json
from .export_files import Folders, common_root, inside, left_out, named, sha256
from .export_items import ExportOptions, ExportSummary, Forbidden, Item, Origin, item_fields, item_text
from .results import MediaPolicy, cell_refs, job_pictures, media_columns

__all__ = ["write_imagefolder"]

_MANIFEST = ".batchgen-export.json"  # in an imagefolder: the digest of the metadata.jsonl batchgen wrote


def write_imagefolder(
    items: list[Item],
    columns: dict[str, list[int]],
    fields: dict[str, tuple[int, str]],
    options: ExportOptions,
    summary: ExportSummary,
    forbidden: Forbidden,
    origin: Origin,
) -> None:
    """`metadata.jsonl` beside the pictures, or in `--to` with the pictures copied (or linked)
    into it and those held as bytes written out, so `datasets` loads them."""
    held = sum(i.source == "bytes" for i in items)
    if options.to is None and held:
        raise ConfigError(
            f"{held} picture(s) are bytes inside the results or the job: give --to DIR to "
            "write them out with metadata.jsonl"
        )
    chosen = []
    for item in items:
        if item.path is not None or item.source == "bytes":
            chosen.append(item)
        else:
            left_out(item, summary)
    root = common_root([named(i) for i in chosen if i.path is not None])
    folder = options.to or root
    if options.to is None:
        _check_root(root, origin.policy)
    _find_bytes(chosen, origin)
    places = _places(chosen, root, options.to, forbidden)
    metadata = folder / "metadata.jsonl"
    forbidden.check(metadata, "metadata")
    _check_ours(metadata)
    folders = Folders()
    lines = []
    for item, (target, name) in zip(chosen, places, strict=True):
        texts = {column: item_text(item, ks, options) for column, ks in columns.items()}
        if any(t is None for t in texts.values()):  # a failed row (a broken image): left out
            summary.failed += 1
            continue
        if not all(texts.values()):
            summary.empty += 1
            continue
        if item.path is None and item.data is None:
            summary.missing += 1  # bytes neither the results nor the job (as the run read it) hold
            continue
        try:
            if options.to is not None:
                folders.ready(target.parent)
                _place(item.path, item.data, target, options.link)
                summary.pictures += 1
        except OSError as e:
            summary.errors.append(f"{describe(str(target))} ({short(e)})")
            continue
        record = {"file_name": name, **texts, **item_fields(item, fields)}
        lines.append(strict_json(record, ensure_ascii=False) + "\n")
        summary.written += 1
    folders.ready(folder)
    _write_metadata(metadata, "".join(lines))
    summary.where = [str(metadata)]


def _write_metadata(metadata: Path, text: str) -> None:
    """metadata.jsonl, whole, and beside it the manifest by which a later export knows it for
    batchgen's (as it is)."""
    atomic_write(metadata, lambda p: p.write_text(text, encoding="utf-8"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    manifest = json.dumps({"metadata.jsonl": digest}) + "\n"
    atomic_write(metadata.parent / _MANIFEST, lambda p: p.write_text(manifest))


def _check_root(root: Path, policy: MediaPolicy) -> None:
    """Without --to, metadata.jsonl goes into the folder the pictures share: inside the folder
    the job's paths start from, or a folder of pictures elsewhere (`caption ~/photos` from
    another folder), never a filesystem root or a folder above the job's (`/` or the home
    folder for unrelated trees)."""
    within = policy.root or policy.base
    shared = root.resolve()
    inside = within is not None and shared.is_relative_to(within.resolve())
    above = within is None or within.resolve().is_relative_to(shared)
    if shared == Path(shared.anchor) or not inside and above:
        raise ConfigError(
            f"the pictures share no folder of their own (their common folder is {root}, "
            f"above the job's): give --to DIR for a new dataset folder"
        )


def _check_ours(metadata: Path) -> None:
    """A metadata.jsonl already there is replaced only if batchgen wrote it, as it is."""
    if not os.path.lexists(metadata):
        return
    try:
        recorded = json.loads((metadata.parent / _MANIFEST).read_text()).get("metadata.jsonl")
        ours = stat.S_ISREG(metadata.lstat().st_mode) and file_digest(metadata) == recorded
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise ConfigError(
            f"{metadata}: already there and not written by batchgen (or edited since); move "
            "it away or give --to DIR for a new dataset folder"
        )


def _places(items: list[Item], root: Path, to: Path | None, forbidden: Forbidden) -> list[tuple[Path, str]]:
    """Each picture's place in the dataset folder and its `file_name` there: local pictures
    keep their path as the job named it under the pictures' shared folder (without --to, the
    place is the picture itself, reached as the job named it); pictures from bytes are named
    by their row (and their digest, where two rows' names meet), with their format's extension."""
    places: list[tuple[Path, str]] = []
    taken: set[Path] = set()
    folder = to or root
    for item in items:
        if item.path is not None:
            rel = named(item).relative_to(root)
            target = inside(folder, rel) if to is not None else item.path
        else:
            stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in item.key)[:80] or "image"
            ext = _format_extension(item.data) if item.data is not None else ".png"
            target = inside(folder, Path(stem + ext))
            if target in taken:
                target = inside(folder, Path(f"{stem}-{(item.digest or '')[:12]}{ext}"))
        why = "another picture's place" if target in taken else forbidden.why(target, item.path)
        if why:
            raise ConfigError(f"{describe(str(target))}: is {why}; give --to another folder")
        taken.add(target)
        places.append((target, rel.as_posix() if item.path is not None else target.name))
    return places


def _find_bytes(items: list[Item], origin: Origin) -> None:
    """The bytes of pictures held as bytes, matched by digest to what the run read: from the
    results' media columns (a kept `jpg`), else from the job, whose rows must be as the run
    read them."""
    wanted = {i.digest: i for i in items if i.digest is not None}
    if not wanted:
        return
    columns = media_columns(origin.about)
    by_id = {id_key(r["id"]): r for r in origin.rows}
    need: dict[str, str | None] = {}
    for item in wanted.values():
        for key, input_hash in zip(item.ids, item.hashes, strict=True):
            cells = (ref for c, _ in columns for ref in cell_refs(by_id[key].get(c)))
            item.data = next((r for r in cells if isinstance(r, bytes) and sha256(r) == item.digest), None)
            if item.data is not None:
                break
            need[key] = input_hash
    for pictures in job_pictures(origin.about, need, columns, origin.policy, len(need)).values():
        for picture in pictures:
            if (found := wanted.get(sha256(picture))) is not None:
                found.data = picture


_FORMAT_EXTENSIONS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp",
                      "TIFF": ".tif"}  # fmt: skip


def _format_extension(data: bytes) -> str:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _FORMAT_EXTENSIONS.get(img.format or "", ".png")
    except Exception:  # noqa: BLE001 - the run decoded it; a header Pillow now refuses keeps .png
        return ".png"


_FICLONE = 0x40049409  # Linux's ioctl that shares a file's blocks (btrfs, XFS): a copy in no time


def _place(source: Path | None, data: bytes | None, target: Path, link: str) -> None:
    """A picture into the dataset folder: a copy (a reflink where the filesystem can) that the
    trainer may edit without touching the original, or a link when asked; bytes written out.
    A target that already is the same picture is kept."""
    if source is None:
        data = data or b""
        if not (_regular(target) and target.stat().st_size == len(data) and target.read_bytes() == data):
            atomic_write(target, lambda p: p.write_bytes(data))
    elif not _same(source, target, link):
        if link == "copy":
            atomic_write(target, lambda p: _copy(source, p))
        elif link == "hard":
            _link(target, lambda p: os.link(source, p))
        else:
            _link(target, lambda p: os.symlink(source.resolve(), p))


def _regular(path: Path) -> bool:
    return not path.is_symlink() and path.is_file()


def _same(source: Path, target: Path, link: str) -> bool:
    try:
        if target.parent.resolve() / target.name == source.resolve():
            return True  # --to the pictures' own folder: each picture is already in its place
        if link == "symbolic":
            return target.is_symlink() and Path(os.readlink(target)) == source.resolve()
        if not _regular(target):
            return False
        if os.path.samefile(source, target):
            return link == "hard"  # a hard link where a copy is asked for is replaced by a copy
        a, b = source.stat(), target.stat()
        return link == "copy" and (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)
    except OSError:
        return False


def _link(target: Path, make: Callable[[Path], None]) -> None:
    """A link made under a temporary name, then renamed over the target (never written through)."""
    tmp = target.with_name(f"{TEMP_PREFIX}{secrets.token_hex(6)}{TEMP_SUFFIX}")
    try:
        make(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def _copy(source: Path, target: Path) -> None:
    """A reflink where the filesystem shares blocks, else a byte copy; the mtime kept."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        except OSError:
            shutil.copyfileobj(src, dst, 1 << 20)
    shutil.copystat(source, target)

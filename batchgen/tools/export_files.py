"""What `export --format txt` writes: a caption file beside each picture, or mirrored under `--to`.

Each file is written whole; the helpers both file layouts share are here too (the pictures'
common folder, a target kept inside its folder, folders made once).

Every target is checked before the first write: none may be a media file the results name,
the results themselves or the job, and two pictures may not share one caption file. A caption
file batchgen wrote (its digest in its folder's `.batchgen-captions.json`) is refreshed when its
answer changed; any other is the user's. A file that cannot be written is counted and named;
the export goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from ..core.errors import ConfigError, describe, short
from ..output.store import atomic_write, json_object, read_small, stale_temps
from .export_items import ExportOptions, ExportSummary, Forbidden, Item, item_text

__all__ = ["write_txt", "left_out", "common_root", "inside", "Folders", "named", "sha256"]

_CAPTION_BYTES = 1 << 20  # an existing caption file read for append/prepend: more is no caption file
_CAPTIONS = ".batchgen-captions.json"  # in a folder of caption files: the digest of each batchgen wrote
_CAPTIONS_BYTES = 1 << 28  # a manifest names each caption file of its folder in under 100 bytes
_SHOWN = 3  # names a message lists


def left_out(item: Item, summary: ExportSummary) -> None:
    """An item without a local file to write for, counted by what it is."""
    if item.source == "url":
        summary.remote += 1
    elif item.source == "bytes":
        summary.as_bytes += 1
    elif item.source == "none":
        summary.without_media += 1
    else:
        summary.missing += 1


def common_root(paths: list[Path]) -> Path:
    return Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path(".")


def inside(root: Path, rel: Path) -> Path:
    target = (root / rel).resolve()
    if not target.is_relative_to(root.resolve()):  # a results file naming `../..`: never outside
        raise ConfigError(f"{describe(str(rel))}: would be written outside {root}")
    return target


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return "; ".join(names[:_SHOWN]) + more


def _caption_targets(items: list[Item], options: ExportOptions) -> dict[Path, Item]:
    """Each picture's caption file; two pictures sharing one (`a.png`, `a.jpg` → `a.txt`) are
    refused, naming them."""
    files = [i for i in items if i.path is not None]
    root = common_root([named(i) for i in files])
    targets: dict[Path, Item] = {}
    clashes: list[str] = []
    ext = options.caption_extension
    for item, path in ((i, i.path) for i in items if i.path is not None):
        beside = path  # the picture itself (a caption file goes beside the file, wherever a link led)
        if options.to is not None:  # mirrored as the job named the picture
            beside = inside(options.to, named(item).relative_to(root))
        with_extension = options.caption_name == "with-extension"
        target = beside.with_name(beside.name + ext) if with_extension else beside.with_suffix(ext)
        if target in targets:
            clashes.append(f"{describe(str(targets[target].path))} and {describe(str(path))} → {target.name}")
        targets.setdefault(target, item)
    if clashes:
        raise ConfigError(
            f"{len(clashes)} picture(s) would share a caption file ({_shown(clashes)}); pass "
            "--caption-name with-extension (a.png → a.png.txt)"
        )
    return targets


def _existing(target: Path) -> bytes | None:
    """An existing caption file's bytes (None: there is none). A FIFO, a device or a link is
    never read (ValueError): reading one blocks, or copies another file's content."""
    try:
        info = target.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file")
    if info.st_size > _CAPTION_BYTES:
        raise ValueError(f"over {_CAPTION_BYTES} bytes: no caption file")
    with open(target, "rb") as f:
        return f.read(_CAPTION_BYTES)


class _Written:
    """The caption files batchgen wrote, as a manifest in each folder that holds some
    (`.batchgen-captions.json`: name → sha256 of the bytes written): a file still holding
    those bytes is batchgen's to refresh when its answer changed; any other is the user's.
    Each manifest is read once, bounded, and rewritten after the export's writes."""

    def __init__(self) -> None:
        self.folders: dict[Path, dict[str, str]] = {}
        self.touched: set[Path] = set()

    def _names(self, folder: Path) -> dict[str, str]:
        if folder not in self.folders:
            found = json_object(read_small(folder / _CAPTIONS, _CAPTIONS_BYTES)) or {}
            self.folders[folder] = {k: v for k, v in found.items() if isinstance(v, str) and len(v) == 64}
        return self.folders[folder]

    def ours(self, target: Path, data: bytes) -> bool:
        return self._names(target.parent).get(target.name) == sha256(data)

    def record(self, target: Path, data: bytes | None) -> None:
        """`data` written at `target` by batchgen (None: what is there now is not only batchgen's)."""
        names = self._names(target.parent)
        if data is not None:
            names[target.name] = sha256(data)
        elif names.pop(target.name, None) is None:
            return
        self.touched.add(target.parent)

    def save(self, summary: ExportSummary) -> None:
        for folder in sorted(self.touched):
            text = json.dumps(self.folders[folder], indent=0, sort_keys=True) + "\n"
            try:
                atomic_write(folder / _CAPTIONS, lambda p, text=text: p.write_text(text))
            except OSError as e:
                summary.errors.append(f"{describe(str(folder / _CAPTIONS))} ({short(e)})")


class Folders:
    """Folders written into: each made once, and cleared of temporary files a killed export
    left there."""

    def __init__(self) -> None:
        self.seen: set[Path] = set()

    def ready(self, folder: Path) -> None:
        if folder in self.seen:
            return
        self.seen.add(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in stale_temps(folder):
            leftover.unlink(missing_ok=True)


def write_txt(
    items: list[Item],
    columns: dict[str, list[int]],
    options: ExportOptions,
    summary: ExportSummary,
    forbidden: Forbidden,
) -> None:
    if len(columns) != 1:
        raise ConfigError(
            "a caption file holds one text: pick a prompt (--prompt K) or join them (--join ' ')"
        )
    (ks,) = columns.values()
    targets = _caption_targets(items, options)
    for target in targets:
        forbidden.check(target, "caption file")
    for folder in {t.parent for t in targets}:
        forbidden.check(folder / _CAPTIONS, "caption manifest")
    for item in items:
        if item.path is None:
            left_out(item, summary)
    folders, written = Folders(), _Written()
    for target, item in targets.items():
        text = item_text(item, ks, options)
        if not text:
            summary.failed += text is None
            summary.empty += text == ""
            continue
        try:
            data = _caption(target, text, options, summary, written)
            if data is None:
                continue
            folders.ready(target.parent)
            atomic_write(target, lambda p, data=data: p.write_bytes(data))
            summary.written += 1
            written.record(target, data if options.on_existing in ("skip", "overwrite") else None)
        except ValueError as e:
            summary.refused.append(f"{describe(str(target))} ({e})")
        except OSError as e:  # a name too long for the filesystem, no room, no permission
            summary.errors.append(f"{describe(str(target))} ({short(e)})")
    written.save(summary)
    summary.where = [str(options.to or common_root([named(i) for i in targets.values()]))] if targets else []
    if summary.as_bytes and not targets:
        summary.note = (
            f"{summary.as_bytes} picture(s) are bytes inside the results or the job, not "
            "files: no caption file can go beside them (--format imagefolder --to DIR writes "
            "them out with their captions)"
        )


def _caption(
    target: Path, text: str, options: ExportOptions, summary: ExportSummary, written: _Written
) -> bytes | None:
    """The bytes to write at `target` (None: nothing to write, counted). A file batchgen wrote
    there is refreshed when the answer changed (kept when it says the same); another file is
    the user's: kept (`skip`), replaced, or extended as `--on-existing` says."""
    new = (text + "\n").encode()
    old = _existing(target)
    if old is None:
        return new
    if written.ours(target, old) and options.on_existing in ("skip", "overwrite"):
        if old == new:
            summary.current += 1
            return None
        return new
    if options.on_existing == "skip":
        summary.skipped += 1
        return None
    kept = old.decode("utf-8", errors="replace")
    if options.on_existing == "append":
        return (kept.rstrip("\n") + options.separator + text + "\n").encode()
    if options.on_existing == "prepend":
        return (text + options.separator + kept.strip("\n") + "\n").encode()
    return new


def named(item: Item) -> Path:
    """A local picture as the job named it (a folder linked in stays where it was linked)."""
    if item.named is not None:
        return item.named
    if item.path is None:
        raise ValueError(f"{item.ref!r:.80} is not a local picture")
    return item.path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

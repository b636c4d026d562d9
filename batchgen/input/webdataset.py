"""WebDataset shards (img2dataset's `--output_format webdataset`): one row per sample key.

A sample is the run of tar members sharing a key (`00000042.jpg`, `00000042.txt`,
`00000042.json`): its image member becomes the row's `image`, a video member its `video`,
`.txt` its `caption`, the `.json` object's fields its columns, and the key its `id`. The tar is
read as a stream, never whole; a row can be found again from the byte offset of its first
member, which is where a mark points.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ..core.records import ByteCaps, Values
from .rows import Mark, RawRow, ReadPolicy, checked

__all__ = ["iter_tar", "IMAGE_MEMBERS", "VIDEO_MEMBERS"]

IMAGE_MEMBERS = {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"}
VIDEO_MEMBERS = {"mp4", "webm", "mkv", "avi", "mov"}
_TEXT_MEMBERS = {"txt", "text", "caption", "cls", "id"}


def _split(name: str) -> tuple[str, str]:
    """(key, extension) by webdataset's rule: the extension starts at the basename's first dot."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def _cap(ext: str, caps: ByteCaps) -> tuple[str, int]:
    """The kind a member is capped as, and its cap: images and videos by their own caps, any
    other member (text, JSON, a binary column) by the image cap."""
    return ("video", caps.video) if ext in VIDEO_MEMBERS else ("image", caps.image)


@dataclass(slots=True)
class _Member:
    ext: str
    size: int
    mtime: float
    data: bytes | None  # None: over its cap, or a body the scan does not read


def _sample(key: str, members: list[_Member], caps: ByteCaps) -> tuple[Values, str | None]:
    """A row's value from its members, and the first problem with them."""
    value: Values = {}
    problem = None
    images, videos = [], []
    for m in members:
        kind, cap = _cap(m.ext, caps)
        if m.size > cap:
            problem = (
                problem or f"member {key}.{m.ext} of {m.size:,} bytes is over the {kind} cap ({cap:,} bytes)"
            )
            continue
        data = m.data if m.data is not None else b""
        if m.ext in IMAGE_MEMBERS:
            images.append(data)
        elif m.ext in VIDEO_MEMBERS:
            videos.append(data)
        elif m.ext == "json":
            try:
                fields = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                problem = problem or f"member {key}.json is not JSON ({type(e).__name__})"
                continue
            if isinstance(fields, dict):
                value.update(fields)
            else:
                value["json"] = fields
        elif m.ext in _TEXT_MEMBERS:
            text = data.decode("utf-8", "replace")
            value["caption" if m.ext in ("txt", "text") else m.ext] = text
        else:
            value[m.ext or "data"] = data
    if images:
        value["image"] = images[0] if len(images) == 1 else images
    if videos:
        value["video"] = videos[0] if len(videos) == 1 else videos
    value["id"] = key
    return value, problem


def _fingerprint(key: str, members: list[_Member]) -> str:
    """A sample's fingerprint from its tar headers (name, size, time) and its small text
    members' content: the same whether or not the bodies were read, so the scan reads none."""
    parts = [
        [
            m.ext,
            m.size,
            m.mtime,
            m.data.decode("utf-8", "replace") if m.ext in _READ_IN_SCAN and m.data else None,
        ]
        for m in members
    ]
    return hashlib.sha256(json.dumps([key, parts]).encode()).hexdigest()[:32]


_READ_IN_SCAN = {"json", *_TEXT_MEMBERS}  # columns and ids live in these: small, read by the scan too


def iter_tar(f: BinaryIO, start: Mark, policy: ReadPolicy) -> Iterator[tuple[RawRow, Mark]]:
    """The samples of one tar from `start` (its `seek` the offset of a sample's first member).
    A member over its cap is skipped by its header, never read; without `policy.bodies` (the
    scan) only the text and JSON members are read, and media members are seeked over."""
    caps = policy.caps
    f.seek(start.seek)
    index = start.index
    key: str | None = None
    members: list[_Member] = []
    first = start.seek

    def row(key: str) -> tuple[RawRow, Mark]:
        value, problem = _sample(key, members, caps)
        fingerprint = _fingerprint(key, members)
        raw = RawRow(index=index, line=None, value=value, error=problem, fingerprint=fingerprint)
        return (checked(raw) if problem is None else raw), Mark(index, first, 0, start.shard)

    with tarfile.open(fileobj=f, mode="r:") as tar:  # seekable: skipped bodies are seeked over
        while (member := tar.next()) is not None:
            vars(tar)["members"].clear()  # tarfile keeps every header it read: millions in a large shard
            if not member.isfile():
                continue
            name, ext = _split(member.name)
            if name != key and key is not None:
                yield row(key)
                index += 1
                members = []
            if name != key:
                key, first = name, member.offset
            read = member.size <= _cap(ext, caps)[1] and (policy.bodies or ext in _READ_IN_SCAN)
            data = tar.extractfile(member) if read else None
            members.append(_Member(ext, member.size, member.mtime, data.read() if data is not None else None))
        if key is not None:
            yield row(key)

"""WebDataset shards (img2dataset's `--output_format webdataset`): one row per sample key.

A sample is the run of tar members sharing a key (`00000042.jpg`, `00000042.txt`,
`00000042.json`): its image member becomes the row's `image`, a video member its `video`,
`.txt` its `caption`, the `.json` object's fields its columns, and the key its `id`. The tar is
read as a stream, never whole; a row can be found again from the byte offset of its first
member, which is where a mark points.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from .formats import Mark, RawRow

__all__ = ["iter_tar", "IMAGE_MEMBERS", "VIDEO_MEMBERS"]

IMAGE_MEMBERS = {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"}
VIDEO_MEMBERS = {"mp4", "webm", "mkv", "avi", "mov"}
_TEXT_MEMBERS = {"txt", "text", "caption", "cls", "id"}
_MAX_MEMBER = 500 * 2**20  # the video cap: a bigger member is the row's error, never read into memory


def _split(name: str) -> tuple[str, str]:
    """(key, extension) by webdataset's rule: the extension starts at the basename's first dot."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


def _sample(key: str, members: list[tuple[str, bytes | None, int]]) -> tuple[dict[str, Any], str | None]:
    """A row's value from its members, and the first problem with them."""
    value: dict[str, Any] = {}
    problem = None
    images, videos = [], []
    for ext, data, size in members:
        if data is None:
            problem = problem or f"member {key}.{ext} of {size} bytes is over the {_MAX_MEMBER} byte cap"
        elif ext in IMAGE_MEMBERS:
            images.append(data)
        elif ext in VIDEO_MEMBERS:
            videos.append(data)
        elif ext == "json":
            try:
                fields = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                problem = problem or f"member {key}.json is not JSON ({type(e).__name__})"
                continue
            if isinstance(fields, dict):
                value.update(fields)
            else:
                value["json"] = fields
        elif ext in _TEXT_MEMBERS:
            text = data.decode("utf-8", "replace")
            value["caption" if ext in ("txt", "text") else ext] = text
        else:
            value[ext or "data"] = data
    if images:
        value["image"] = images[0] if len(images) == 1 else images
    if videos:
        value["video"] = videos[0] if len(videos) == 1 else videos
    value["id"] = key
    return value, problem


def iter_tar(f: BinaryIO, start: Mark) -> Iterator[tuple[RawRow, Mark]]:
    """The samples of one tar from `start` (its `seek` the offset of a sample's first member)."""
    from .formats import Mark, RawRow, checked

    f.seek(start.seek)
    index = start.index
    key: str | None = None
    members: list[tuple[str, bytes | None, int]] = []
    first = start.seek

    def row() -> tuple[RawRow, Mark]:
        value, problem = _sample(key, members)  # type: ignore[arg-type]
        raw = RawRow(index=index, line=None, value=value, error=problem)
        return (checked(raw) if problem is None else raw), Mark(index, first, 0, start.shard)

    with tarfile.open(fileobj=f, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            name, ext = _split(member.name)
            if name != key and key is not None:
                yield row()
                index += 1
                members = []
            if name != key:
                key, first = name, start.seek + member.offset
            if member.size > _MAX_MEMBER:
                members.append((ext, None, member.size))
                continue
            data = tar.extractfile(member)
            members.append((ext, data.read() if data is not None else b"", member.size))
        if key is not None:
            yield row()

"""Fetch stage: turn a media reference (local path, data URL) into bytes or a local file."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .config import MediaLimits
from .errors import RowError
from .records import MediaRef

__all__ = ["Fetched", "fetch", "describe"]

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),", re.ASCII)
# Characters of base64 text allowed per kind: 4/3 of the byte cap plus room for padding.
_B64_FACTOR = 1.5


@dataclass(slots=True)
class Fetched:
    """A media item's bytes (`data`) or, for files read in place, its `path`."""

    ref: MediaRef
    data: bytes | None = None
    path: Path | None = None
    mime: str | None = None

    @property
    def digest(self) -> str:
        """Content digest over all the bytes: equal prefixes must never collide."""
        h = hashlib.sha256()
        if self.data is not None:
            h.update(self.data)
        else:
            with open(self.path, "rb") as f:  # type: ignore[arg-type]
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()


def describe(source: str, width: int = 80) -> str:
    """A reference short enough for a one-line error: data URLs lose their payload."""
    if source.startswith("data:"):
        head = source.split(",", 1)[0]
        return f"{head},… ({len(source)} chars)"
    return source if len(source) <= width else source[: width - 1] + "…"


def _cap(limits: MediaLimits, kind: str) -> int:
    return {"image": limits.image_bytes, "video": limits.video_bytes, "audio": limits.audio_bytes}[kind]


def _from_data_url(ref: MediaRef, limits: MediaLimits) -> Fetched:
    m = _DATA_URL.match(ref.source)
    if not m or ";base64" not in (m.group("params") or ""):
        raise RowError("fetch", f"{describe(ref.source)}: only base64 data URLs are supported")
    mime = m.group("mime") or ""
    if mime and not mime.startswith(ref.kind + "/") and mime != "application/octet-stream":
        raise RowError("fetch", f"{describe(ref.source)}: a {mime} data URL given as {ref.kind}")
    payload = ref.source[m.end() :]
    cap = _cap(limits, ref.kind)
    if len(payload) > cap * _B64_FACTOR:
        raise RowError("fetch", f"{describe(ref.source)}: data URL over the {ref.kind} cap of {cap} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RowError("fetch", f"{describe(ref.source)}: invalid base64 ({e})") from e
    if len(data) > cap:
        raise RowError(
            "fetch", f"{describe(ref.source)}: {len(data)} bytes is over the {ref.kind} cap of {cap}"
        )
    return Fetched(ref, data=data, mime=mime or None)


def _from_path(ref: MediaRef, base_dir: Path, limits: MediaLimits) -> Fetched:
    raw = ref.source[len("file://") :] if ref.source.startswith("file://") else ref.source
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        raise RowError("fetch", f"{describe(ref.source)}: no such file ({path})")
    size = path.stat().st_size
    cap = _cap(limits, ref.kind)
    if size > cap:
        raise RowError("fetch", f"{describe(ref.source)}: {size} bytes is over the {ref.kind} cap of {cap}")
    if ref.kind == "image":
        return Fetched(ref, data=path.read_bytes())
    return Fetched(ref, path=path)  # videos and audio are decoded from the file itself


def fetch(ref: MediaRef, base_dir: Path, limits: MediaLimits) -> Fetched:
    """Resolve one reference. Relative paths are relative to the job file's folder."""
    source = ref.source.strip()
    scheme = source.split(":", 1)[0].lower() if re.match(r"^[a-zA-Z][\w+.-]*:", source) else ""
    if scheme == "data":
        return _from_data_url(MediaRef(ref.kind, source), limits)
    if scheme in ("http", "https"):
        raise RowError("fetch", f"{describe(source)}: http(s) media are not supported by this build")
    if scheme in ("", "file") or len(scheme) == 1:  # len 1: a Windows drive letter
        return _from_path(MediaRef(ref.kind, source), base_dir, limits)
    raise RowError("fetch", f"{describe(source)}: unsupported scheme {scheme!r}")

"""Fetch stage: a media reference (http(s) URL, data URL, local path) → bytes or a local file.

Remote fetches are the dangerous part: by default only globally routable hosts are
contacted (every redirect hop is checked again), downloads stream under a byte cap and an
overall deadline, and transient failures are retried with backoff. Each URL is fetched
once per run; `media_cache` keeps downloads across runs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import requests
import urllib3

from .cache import Memo
from .config import MediaConfig
from .errors import RowError
from .records import MediaRef

__all__ = ["Fetched", "Fetcher", "describe", "check_url"]

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),", re.ASCII)
_B64_FACTOR = 4 / 3 + 0.01  # base64 text per byte, with room for padding and line breaks
_MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_EXTENSIONS = {
    "image/jpeg": ".jpg", "image/png": ".png", "image/gif": ".gif", "image/webp": ".webp",
    "video/mp4": ".mp4", "video/webm": ".webm", "video/x-msvideo": ".avi", "video/quicktime": ".mov",
    "video/x-matroska": ".mkv", "audio/wav": ".wav", "audio/x-wav": ".wav", "audio/mpeg": ".mp3",
    "audio/flac": ".flac", "audio/ogg": ".ogg", "audio/mp4": ".m4a",
}  # fmt: skip


@dataclass(slots=True)
class Fetched:
    """A media item's bytes (`data`) or a local file holding them (`path`)."""

    ref: MediaRef
    data: bytes | None = None
    path: Path | None = None
    mime: str | None = None
    _digest: str | None = None

    def read(self) -> bytes:
        return self.data if self.data is not None else self.path.read_bytes()  # type: ignore[union-attr]

    @property
    def digest(self) -> str:
        """sha256 of all the bytes: equal prefixes (one renderer's JPEG headers) never collide."""
        if self._digest is None:
            h = hashlib.sha256()
            if self.data is not None:
                h.update(self.data)
            else:
                with open(self.path, "rb") as f:  # type: ignore[arg-type]
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            self._digest = h.hexdigest()
        return self._digest


def describe(source: str, width: int = 80) -> str:
    """A reference short enough for a one-line error: data URLs lose their payload."""
    if source.startswith("data:"):
        return f"{source.split(',', 1)[0]},… ({len(source)} chars)"
    return source if len(source) <= width else source[: width - 1] + "…"


def _resolve(host: str, port: int) -> list[str]:
    """Every address the host resolves to (tests patch this to fake public DNS)."""
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url(url: str, allow_private: bool) -> None:
    """Refuse what the SSRF policy forbids; raises a `fetch` RowError naming the reason."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise RowError("fetch", f"{describe(url)}: only http and https URLs are fetched")
    host = parts.hostname
    if not host:
        raise RowError("fetch", f"{describe(url)}: URL without a host")
    if allow_private:
        return
    if host == "localhost" or host.endswith(".localhost"):
        raise RowError(
            "fetch", f"{describe(url)}: refused: {host} is local (--allow-private-urls permits it)"
        )
    try:
        addresses = _resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError, ValueError) as e:
        raise RowError("fetch", f"{describe(url)}: cannot resolve {host} ({e})") from e
    private = [a for a in addresses if not _is_public(a)]
    if private or not addresses:
        raise RowError(
            "fetch",
            f"{describe(url)}: refused: {host} resolves to non-public address {', '.join(private)} "
            "(--allow-private-urls permits it)",
        )


class _Retry(Exception):
    def __init__(self, reason: str, wait: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.wait = wait


def _retry_after(value: str | None) -> float | None:
    try:
        return min(float(value), 30.0) if value else None  # honoured, but never for long
    except ValueError:
        return None


class Fetcher:
    """The run's one fetcher: HTTP session, URL table, on-disk cache and counters."""

    def __init__(self, config: MediaConfig, base_dir: Path, tmp_dir: Path):
        self.config = config
        self.base_dir = base_dir
        self.tmp_dir = tmp_dir
        self._local = threading.local()  # a requests.Session per worker thread
        self._urls: Memo[Fetched] = Memo(capacity=1_000_000)  # url → file on disk: tiny entries
        self._paths: Memo[Fetched] = Memo(capacity=100_000)  # local path → its Fetched (digest cached)
        self._lock = threading.Lock()
        self._seq = 0
        self.downloads = 0  # HTTP GETs that returned a body
        self.download_bytes = 0
        self.retries = 0
        self.cache_hits = 0  # URLs served from --media-cache

    @property
    def url_reuses(self) -> int:
        return self._urls.hits

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.trust_env = False  # no proxies or .netrc from the environment
        return self._local.session

    def _cap(self, kind: str) -> int:
        c = self.config
        return {"image": c.image_bytes, "video": c.video_bytes, "audio": c.audio_bytes}[kind]

    def _timeout(self, kind: str) -> float:
        c = self.config
        return {"image": c.image_timeout, "video": c.video_timeout, "audio": c.audio_timeout}[kind]

    def fetch(self, ref: MediaRef) -> Fetched:
        source = ref.source.strip()
        scheme = source.split(":", 1)[0].lower() if re.match(r"^[a-zA-Z][\w+.-]*:", source) else ""
        if scheme == "data":
            return self._from_data_url(MediaRef(ref.kind, source))
        if scheme in ("http", "https"):
            return self._urls.get((ref.kind, source), lambda: self._from_url(MediaRef(ref.kind, source)))
        if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # a Windows drive letter
            # Memoized too: rows sharing a file (a video asked several questions) hash it once.
            return self._paths.get((ref.kind, source), lambda: self._from_path(MediaRef(ref.kind, source)))
        raise RowError(
            "fetch", f"{describe(source)}: unsupported scheme {scheme!r} (use http(s), data: or a path)"
        )

    # -- data URLs and local files ------------------------------------------------
    def _from_data_url(self, ref: MediaRef) -> Fetched:
        m = _DATA_URL.match(ref.source)
        if not m or ";base64" not in (m.group("params") or ""):
            raise RowError("fetch", f"{describe(ref.source)}: only base64 data URLs are supported")
        mime = m.group("mime") or ""
        if mime and not mime.startswith(ref.kind + "/") and mime != "application/octet-stream":
            raise RowError("fetch", f"{describe(ref.source)}: a {mime} data URL given as {ref.kind}")
        payload = ref.source[m.end() :]
        cap = self._cap(ref.kind)
        if len(payload) > cap * _B64_FACTOR:
            raise RowError(
                "fetch", f"{describe(ref.source)}: data URL over the {ref.kind} cap of {cap} bytes"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RowError("fetch", f"{describe(ref.source)}: invalid base64 ({e})") from e
        if len(data) > cap:
            raise RowError(
                "fetch", f"{describe(ref.source)}: {len(data)} bytes is over the {ref.kind} cap of {cap}"
            )
        return Fetched(ref, data=data, mime=mime or None)

    def _from_path(self, ref: MediaRef) -> Fetched:
        path = Path(ref.source).expanduser()
        if not path.is_absolute():
            path = self.base_dir / path
        if self.config.media_root is not None:
            root = Path(self.config.media_root).resolve()
            if not path.resolve().is_relative_to(root):
                raise RowError("fetch", f"{describe(ref.source)}: outside the media root {root}")
        if not path.is_file():
            raise RowError("fetch", f"{describe(ref.source)}: no such file ({path})")
        size = path.stat().st_size
        cap = self._cap(ref.kind)
        if size > cap:
            raise RowError(
                "fetch", f"{describe(ref.source)}: {size} bytes is over the {ref.kind} cap of {cap}"
            )
        return Fetched(ref, path=path)

    # -- http(s) -------------------------------------------------------------------
    def _cache_paths(self, url: str) -> tuple[Path, Path] | None:
        if not self.config.media_cache:
            return None
        root = Path(self.config.media_cache)
        return root / "urls" / hashlib.sha256(url.encode()).hexdigest(), root / "blobs"

    def _from_url(self, ref: MediaRef) -> Fetched:
        cached = self._cache_paths(ref.source)
        if cached and cached[0].is_file():
            digest = cached[0].read_text().strip()
            blob = cached[1] / digest
            if blob.is_file():
                with self._lock:
                    self.cache_hits += 1
                return Fetched(ref, path=blob, _digest=digest)
        item = self._download(ref)
        if cached:
            self._store(item, *cached)
        return item

    def _store(self, item: Fetched, index: Path, blobs: Path) -> None:
        """Content-addressed copy plus a URL index entry, each written atomically."""
        blobs.mkdir(parents=True, exist_ok=True)
        index.parent.mkdir(parents=True, exist_ok=True)
        blob = blobs / item.digest
        tmp_suffix = f".tmp-{os.getpid()}-{threading.get_ident()}"
        if not blob.exists():
            tmp = blob.with_name(blob.name + tmp_suffix)
            tmp.write_bytes(item.read())
            os.replace(tmp, blob)
        tmp = index.with_name(index.name + tmp_suffix)
        tmp.write_text(item.digest)
        os.replace(tmp, index)

    def _download(self, ref: MediaRef) -> Fetched:
        attempts = self.config.retries
        for attempt in range(1, attempts + 1):
            try:
                return self._attempt(ref)
            except _Retry as r:
                if attempt == attempts:
                    raise RowError(
                        "fetch", f"{describe(ref.source)}: {r.reason} (after {attempts} attempts)"
                    ) from None
                backoff = min(8.0, 0.25 * 2 ** (attempt - 1)) * (0.5 + random.random())  # jittered
                with self._lock:
                    self.retries += 1
                time.sleep(r.wait if r.wait is not None else backoff)
        raise AssertionError("unreachable")

    def _attempt(self, ref: MediaRef) -> Fetched:
        kind, url = ref.kind, ref.source
        timeout = self._timeout(kind)
        deadline = time.monotonic() + timeout
        per_read = min(timeout, 10.0)  # a stalled socket is noticed well before the deadline
        session = self._session()
        for _ in range(_MAX_REDIRECTS + 1):
            check_url(url, self.config.allow_private_urls)
            try:
                response = session.get(url, stream=True, allow_redirects=False, timeout=per_read)
            except (requests.ConnectionError, requests.Timeout) as e:
                raise _Retry(f"{type(e).__name__}: {_short(e)}") from e
            except requests.RequestException as e:
                raise RowError("fetch", f"{describe(ref.source)}: {_short(e)}") from e
            with response:
                if response.status_code in (301, 302, 303, 307, 308):
                    location = response.headers.get("Location")
                    if not location:
                        raise RowError("fetch", f"{describe(ref.source)}: redirect without a Location header")
                    url = urljoin(url, location)
                    continue
                status = response.status_code
                if status == 429 or status >= 500:
                    raise _Retry(f"HTTP {status}", _retry_after(response.headers.get("Retry-After")))
                if status >= 400:
                    raise RowError(
                        "fetch", f"{describe(ref.source)}: HTTP {status} {response.reason or ''}".rstrip()
                    )
                return self._stream(ref, response, deadline)
        raise RowError("fetch", f"{describe(ref.source)}: more than {_MAX_REDIRECTS} redirects")

    def _stream(self, ref: MediaRef, response: requests.Response, deadline: float) -> Fetched:
        """Save the body to a temp file, stopping at the cap or the deadline, whichever first."""
        cap = self._cap(ref.kind)
        declared = response.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise RowError(
                "fetch",
                f"{describe(ref.source)}: Content-Length {declared} is over the {ref.kind} cap of {cap}",
            )
        mime = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower() or None
        with self._lock:
            self._seq += 1
            tmp = self.tmp_dir / f"download-{self._seq}.part"
        h = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in _chunks(response):
                    size += len(chunk)
                    if size > cap:
                        raise RowError(
                            "fetch", f"{describe(ref.source)}: body over the {ref.kind} cap of {cap} bytes"
                        )
                    if time.monotonic() > deadline:
                        raise _Retry(f"download took over {self._timeout(ref.kind):g} s")
                    h.update(chunk)
                    f.write(chunk)
        except (requests.ConnectionError, requests.Timeout, urllib3.exceptions.HTTPError, OSError) as e:
            tmp.unlink(missing_ok=True)
            raise _Retry(f"{type(e).__name__}: {_short(e)}") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        digest = h.hexdigest()
        path = self.tmp_dir / (digest + _extension(mime, ref.source))
        os.replace(tmp, path)
        with self._lock:
            self.downloads += 1
            self.download_bytes += size
        return Fetched(ref, path=path, mime=mime, _digest=digest)


def _chunks(response: requests.Response):
    """Bytes as they arrive (one socket read each), so a trickling server meets the deadline."""
    while chunk := response.raw.read1(_CHUNK, decode_content=True):
        yield chunk


def _extension(mime: str | None, url: str) -> str:
    """From the Content-Type, else the URL path: decoders like OpenCV look at it."""
    if mime in _EXTENSIONS:
        return _EXTENSIONS[mime]
    suffix = Path(urlsplit(url).path).suffix.lower()
    return suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ""


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:200]

"""Fetch stage: a media reference (http(s) URL, data URL, local path) → bytes or a local file.

Remote fetches are the dangerous part: by default only globally routable hosts are
contacted (every redirect hop is checked again), downloads stream under a byte cap and an
overall deadline, and transient failures are retried with backoff. Each URL is fetched
once per run; `media_cache` keeps downloads across runs.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import math
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import urllib3

from ..core.errors import RowError, describe, short
from ..core.files import RefusedPath, file_digest, row_path
from ..core.memo import Memo
from ..core.records import MediaFile, MediaRef
from ..core.settings import MediaConfig
from .url_policy import Target, check_url

__all__ = ["Fetched", "Fetcher"]

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),", re.ASCII)
_B64_FACTOR = 4 / 3 + 0.01  # base64 text per byte, with room for padding and line breaks
_MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_POOLS = 64  # keep-alive pools per thread (one per host and address)
_HEADERS = {"User-Agent": "batchgen", "Accept-Encoding": "gzip, deflate"}
_EXTENSIONS = {
    "image/jpeg": ".jpg", "image/png": ".png", "image/gif": ".gif", "image/webp": ".webp",
    "video/mp4": ".mp4", "video/webm": ".webm", "video/x-msvideo": ".avi", "video/quicktime": ".mov",
    "video/x-matroska": ".mkv", "audio/wav": ".wav", "audio/x-wav": ".wav", "audio/mpeg": ".mp3",
    "audio/flac": ".flac", "audio/ogg": ".ogg", "audio/mp4": ".m4a",
}  # fmt: skip


def _text(ref: MediaRef) -> str:
    """A reference the fetcher reads: a URL, data URL or path (media given as bytes never
    reach it: resolve hands them over as they are)."""
    if not isinstance(ref.source, str):
        raise TypeError("media bytes are not fetched")
    return ref.source


@dataclass(slots=True)
class Fetched:
    """A media item's bytes (`data`) or a local file holding them (`path`)."""

    ref: MediaRef
    data: bytes | None = None
    path: Path | None = None
    mime: str | None = None
    _digest: str | None = None
    size: int | None = None  # a file's bytes (data: len(data))
    mtime_ns: int | None = None  # a local file's, stat'ed before it is read

    def record(self) -> MediaFile:
        """What the row's result keeps of it: its reference (not bytes or a data URL), size,
        a local file's mtime, and the content digest if it was computed."""
        source = self.ref.source
        ref = source.strip() if isinstance(source, str) and not source.lstrip().startswith("data:") else None
        size = self.size if self.size is not None else len(self.data or b"")
        return MediaFile(kind=self.ref.kind, ref=ref, size=size, mtime_ns=self.mtime_ns, sha256=self._digest)

    def read(self) -> bytes:
        return self.data if self.data is not None else self._file().read_bytes()

    def _file(self) -> Path:
        if self.path is None:
            raise ValueError(f"{describe(self.ref.source)}: neither bytes nor a file")
        return self.path

    @property
    def digest(self) -> str:
        """sha256 of all the bytes: equal prefixes (one renderer's JPEG headers) never collide."""
        if self._digest is None:
            self._digest = (
                hashlib.sha256(self.data).hexdigest() if self.data is not None else file_digest(self._file())
            )
        return self._digest


class _Retry(Exception):
    def __init__(self, reason: str, wait: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.wait = wait


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date); honoured, but
    never for long, and nonsense (negative, nan) is ignored."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return min(max(seconds, 0.0), 30.0) if math.isfinite(seconds) else None


class Fetcher:
    """The run's one fetcher: HTTP session, URL table, on-disk cache and counters."""

    def __init__(
        self, config: MediaConfig, base_dir: Path | None, tmp_dir: Path, stop: threading.Event | None = None
    ):
        self.config = config
        self.base_dir = base_dir
        self.tmp_dir = tmp_dir
        self.stop = stop or threading.Event()  # set when the run stops: downloads give up at once
        self._local = threading.local()  # connection pools per worker thread
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

    def _cap(self, kind: str) -> int:
        return self.config.caps.of(kind)

    def _timeout(self, kind: str) -> float:
        c = self.config
        return {"image": c.image_timeout, "video": c.video_timeout, "audio": c.audio_timeout}[kind]

    def fetch(self, ref: MediaRef) -> Fetched:
        source = _text(ref).strip()
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
        m = _DATA_URL.match(_text(ref))
        if not m or ";base64" not in (m.group("params") or ""):
            raise RowError("fetch", f"{describe(ref.source)}: only base64 data URLs are supported")
        mime = m.group("mime") or ""
        if mime and not mime.startswith(ref.kind + "/") and mime != "application/octet-stream":
            raise RowError("fetch", f"{describe(ref.source)}: a {mime} data URL given as {ref.kind}")
        payload = _text(ref)[m.end() :]
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

    def _local_file(self, ref: MediaRef) -> tuple[Path, os.stat_result]:
        try:  # a remote job's: one message whatever the path, nothing says what exists here
            path = row_path(_text(ref), self.base_dir, self.config.media_root)
        except RefusedPath as e:
            hint = " (give a URL or the bytes)" if self.base_dir is None else ""
            raise RowError("fetch", f"{describe(ref.source)}: {e}{hint}") from None
        if not path.is_file():
            what = "not a regular file" if path.exists() else "no such file"  # a FIFO would block a read
            raise RowError("fetch", f"{describe(ref.source)}: {what} ({describe(str(path))})")
        return path, path.stat()

    def _from_path(self, ref: MediaRef) -> Fetched:
        try:
            path, stat = self._local_file(ref)
        except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, ~nosuchuser, symlink loops
            raise RowError("fetch", f"{describe(ref.source)}: cannot use this path ({short(e)})") from None
        cap = self._cap(ref.kind)
        if stat.st_size > cap:
            raise RowError(
                "fetch", f"{describe(ref.source)}: {stat.st_size} bytes is over the {ref.kind} cap of {cap}"
            )
        return Fetched(ref, path=path, mtime_ns=stat.st_mtime_ns, size=stat.st_size)

    # -- http(s) -------------------------------------------------------------------
    def _cache_paths(self, url: str) -> tuple[Path, Path] | None:
        if not self.config.media_cache:
            return None
        root = Path(self.config.media_cache)
        return root / "urls" / hashlib.sha256(url.encode()).hexdigest(), root / "blobs"

    def _from_url(self, ref: MediaRef) -> Fetched:
        cached = self._cache_paths(_text(ref))
        if cached and cached[0].is_file():
            digest = cached[0].read_text().strip()
            blob = cached[1] / digest
            if blob.is_file():
                with self._lock:
                    self.cache_hits += 1
                return Fetched(ref, path=blob, _digest=digest, size=blob.stat().st_size)
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
                        "fetch",
                        f"{describe(ref.source)}: {r.reason} (after {attempts} attempts)",
                        transient=True,
                    ) from None
                backoff = min(8.0, 0.25 * 2 ** (attempt - 1)) * (0.5 + random.random())  # jittered
                with self._lock:
                    self.retries += 1
                if self.stop.wait(r.wait if r.wait is not None else backoff):
                    raise RowError(
                        "fetch", f"{describe(ref.source)}: stopped (the run is stopping)", transient=True
                    ) from None
        raise AssertionError("unreachable")

    def _pool(self, target: Target, address: str) -> urllib3.HTTPConnectionPool:
        """A keep-alive pool per thread and (address, host): the connection goes to the
        address that was checked, with the URL's host in the Host header and TLS SNI."""
        pools = self._local.__dict__.setdefault("pools", {})
        key = (target.scheme, address, target.port, target.host)
        if key not in pools:
            if len(pools) >= _POOLS:
                pools.pop(next(iter(pools))).close()
            if target.scheme == "https":
                import certifi

                pools[key] = urllib3.HTTPSConnectionPool(
                    address,
                    target.port,
                    maxsize=1,
                    retries=False,
                    server_hostname=target.host,
                    assert_hostname=target.host,
                    cert_reqs="CERT_REQUIRED",
                    ca_certs=certifi.where(),
                )
            else:
                pools[key] = urllib3.HTTPConnectionPool(address, target.port, maxsize=1, retries=False)
        return pools[key]

    def _attempt(self, ref: MediaRef) -> Fetched:
        kind, url = ref.kind, _text(ref)
        timeout = self._timeout(kind)
        deadline = time.monotonic() + timeout
        per_read = min(timeout, 10.0)  # a stalled socket is noticed well before the deadline
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                target, address = check_url(url, self.config.allow_private_urls)
            except RowError as e:
                if e.transient:  # a DNS failure: tried again, as a connection error is
                    raise _Retry(e.message.split(": ", 1)[-1]) from None
                if url != ref.source:  # a hop: the row's own reference comes first
                    raise RowError(e.stage, f"{describe(ref.source)}: redirected to {e.message}") from None
                raise
            try:
                response = self._pool(target, address).urlopen(
                    "GET",
                    target.path,
                    headers={"Host": target.host_header, **_HEADERS},
                    redirect=False,
                    retries=False,
                    preload_content=False,
                    assert_same_host=False,
                    timeout=urllib3.Timeout(connect=per_read, read=per_read),
                )
            except urllib3.exceptions.SSLError as e:
                raise RowError("fetch", f"{describe(ref.source)}: TLS failed ({short(e)})") from e
            except (urllib3.exceptions.HTTPError, OSError) as e:
                raise _Retry(f"{type(e).__name__}: {short(e)}") from e
            try:
                status = response.status
                if status in (301, 302, 303, 307, 308):
                    location = response.headers.get("Location")
                    if not location:
                        raise RowError("fetch", f"{describe(ref.source)}: redirect without a Location header")
                    try:
                        url = urljoin(url, location.strip())
                    except ValueError as e:
                        raise RowError("fetch", f"{describe(ref.source)}: malformed redirect ({e})") from None
                    continue
                if status == 429 or status >= 500:
                    raise _Retry(f"HTTP {status}", _retry_after(response.headers.get("Retry-After")))
                if status >= 400:
                    raise RowError(
                        "fetch", f"{describe(ref.source)}: HTTP {status} {response.reason or ''}".rstrip()
                    )
                return self._stream(ref, response, deadline)
            finally:
                response.close()
        raise RowError("fetch", f"{describe(ref.source)}: more than {_MAX_REDIRECTS} redirects")

    def _stream(self, ref: MediaRef, response: urllib3.BaseHTTPResponse, deadline: float) -> Fetched:
        """Save the body to a temp file, stopping at the cap, the deadline or a stop request."""
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
                    if self.stop.is_set():
                        raise RowError(
                            "fetch", f"{describe(ref.source)}: stopped (the run is stopping)", transient=True
                        )
                    if time.monotonic() > deadline:
                        raise _Retry(f"download took over {self._timeout(ref.kind):g} s")
                    h.update(chunk)
                    f.write(chunk)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            tmp.unlink(missing_ok=True)
            raise _Retry(f"{type(e).__name__}: {short(e)}") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        digest = h.hexdigest()
        path = self.tmp_dir / (digest + _extension(mime, _text(ref)))
        os.replace(tmp, path)
        with self._lock:
            self.downloads += 1
            self.download_bytes += size
        return Fetched(ref, path=path, mime=mime, _digest=digest, size=size)


def _chunks(response: urllib3.BaseHTTPResponse):
    """Bytes as they arrive (one socket read each), so a trickling server meets the deadline."""
    while chunk := response.read1(_CHUNK, decode_content=True):
        yield chunk


def _extension(mime: str | None, url: str) -> str:
    """From the Content-Type, else the URL path: decoders like OpenCV look at it."""
    if mime in _EXTENSIONS:
        return _EXTENSIONS[mime]
    suffix = Path(urlsplit(url).path).suffix.lower()
    return suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ""

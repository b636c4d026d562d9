"""Media stages for one row: fetch each reference, then decode images or extract frames.

`MediaStage.resolve` runs in worker threads ahead of generation. Identical content is
decoded once per run: decoded images and frames are kept by content digest in bounded
memos (`Decoded`), so rows sharing an image (by URL, path or data URL) share one decode; runs
handed the same `Decoded` (a staged job's stages) share it too.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..core.errors import RowError, Stage, describe, short
from ..core.figures import MediaStats
from ..core.memo import Memo
from ..core.records import IMAGE_DIGEST, Job, Media, MediaFile, MediaItem, MediaRef
from ..core.settings import MediaConfig
from .fetch import Fetched, Fetcher
from .frames import extract_frames
from .images import decode_image, image_size

__all__ = ["Decoded", "MediaStats", "StageTimes", "Prepared", "MediaStage", "Prefetcher"]

_IMAGE_MEMORY = 512 * 2**20  # decoded pixels kept for reuse; a 448² image is 0.6 MB
_FRAMES_MEMORY = 512 * 2**20  # frames are kept at the model's size, ~0.6 Mpx each


@dataclass(frozen=True, slots=True)
class Decoded:
    """Decoded pictures and frames by content (and the bounds they were decoded under), and
    image sizes read from headers: what rows sharing media share. A run makes its own unless
    its caller hands one over to keep them from one run to the next."""

    images: Memo[Image.Image] = field(
        default_factory=lambda: Memo(4096, _IMAGE_MEMORY, lambda im: im.width * im.height * 3)
    )
    frames: Memo[np.ndarray] = field(default_factory=lambda: Memo(256, _FRAMES_MEMORY, lambda a: a.nbytes))
    sizes: Memo[tuple[int, int]] = field(default_factory=lambda: Memo(100_000))  # one header read per content

    def counts(self) -> tuple[int, int, int, int]:
        """Image decodes and reuses, video decodes and reuses, so far."""
        return self.images.misses, self.images.hits, self.frames.misses, self.frames.hits


@dataclass(slots=True)
class StageTimes:
    fetch_ms: float = 0.0
    decode_ms: float = 0.0
    frames_ms: float = 0.0


@dataclass(slots=True)
class Prepared:
    """A row's decoded media and what each stage cost, or the stage error that stopped it."""

    media: Media = field(default_factory=Media)
    times: StageTimes = field(default_factory=StageTimes)
    error: RowError | None = None
    files: list[MediaFile] = field(default_factory=list)  # each item fetched, also when a later step failed

    @property
    def nbytes(self) -> int:
        """Memory held by the decoded media (shared images counted for every row)."""
        m = self.media
        return sum(im.width * im.height * 3 for im in m.images) + sum(v.nbytes for v in m.videos)


_FRAME_PIXELS = 768 * 28 * 28  # Qwen-VL's per-frame maximum, for models that do not say


class MediaStage:
    """The run's media resolver: one fetcher, decode memos, a bound on CPU-heavy work."""

    def __init__(
        self,
        config: MediaConfig,
        base_dir: Path | None,
        tmp_dir: Path,
        audio_from_video: bool = False,
        model_pixels: int | None = None,
        stop: threading.Event | None = None,
        decoded: Decoded | None = None,
    ):
        self.config = config
        self.tmp_dir = tmp_dir
        self.fetcher = Fetcher(config, base_dir, tmp_dir, stop)
        self.decoded = decoded if decoded is not None else Decoded()
        self._counted_from = self.decoded.counts()  # what earlier runs sharing it counted
        self.audio_tracks: Memo[str | None] = Memo(4096)  # files in this run's tmp_dir: not shared
        self.frame_pixels = config.frame_pixels or min(model_pixels or _FRAME_PIXELS, _FRAME_PIXELS)
        self._cpu = threading.BoundedSemaphore(config.decode_workers)
        self._ffmpeg = shutil.which("ffmpeg") if audio_from_video else None

    def stats(self) -> MediaStats:
        f = self.fetcher
        images, image_reuses, videos, video_reuses = (
            now - before for now, before in zip(self.decoded.counts(), self._counted_from, strict=True)
        )
        return MediaStats(
            downloads=f.downloads,
            download_bytes=f.download_bytes,
            download_retries=f.retries,
            url_reuses=f.url_reuses,
            media_cache_hits=f.cache_hits,
            image_decodes=images,
            image_decode_reuses=image_reuses,
            video_decodes=videos,
            video_decode_reuses=video_reuses,
        )

    def resolve(self, job: Job) -> Prepared:
        """Never raises for a row problem: the failure comes back in `Prepared.error`, named
        after the row's own reference and the stage it happened in."""
        out = Prepared()
        stage: Stage = "fetch"
        ref = None
        try:
            for ref in job.media:
                stage = "fetch"
                t0 = time.perf_counter()
                # Bytes from the row itself (a binary column, a tar member) are the media:
                # nothing to fetch, but the same cap as a download.
                item = self._given(ref) if isinstance(ref.source, bytes) else self.fetcher.fetch(ref)
                t1 = time.perf_counter()
                out.times.fetch_ms += (t1 - t0) * 1000
                stage = "decode" if ref.kind == "image" else "frames" if ref.kind == "video" else "fetch"
                try:
                    self._decode_into(job, ref, item, out)
                finally:  # after decoding: its content digest is known then
                    out.files.append(item.record())
                elapsed = (time.perf_counter() - t1) * 1000
                if ref.kind == "image":
                    out.times.decode_ms += elapsed
                else:
                    out.times.frames_ms += elapsed
        except RowError as e:
            name = describe(ref.source) if ref is not None else "media"
            message = e.message if e.stage == "fetch" else f"{name}: {e.message}"
            out.error = RowError(e.stage, message, e.transient)
        except Exception as e:  # noqa: BLE001 - whatever a hostile input raises is this row's error
            name = describe(ref.source) if ref is not None else "media"
            out.error = RowError(stage, f"{name}: {type(e).__name__}: {short(e)}")
        if out.error is not None:
            out.media = Media()  # a failed row holds no decoded media
        return out

    def _given(self, ref: MediaRef) -> Fetched:
        data = ref.source if isinstance(ref.source, bytes) else ref.source.encode()
        cap = self.config.caps.of(ref.kind)
        if len(ref.source) > cap:
            raise RowError(
                "fetch",
                f"{describe(ref.source)}: {len(ref.source):,} bytes is over the "
                f"{ref.kind} cap ({cap:,} bytes)",
            )
        return Fetched(ref, data=data)

    def _budget_left(self, out: Prepared) -> int:
        """Decoded pixels the row may still take (max_row_pixels less its images and frames)."""
        m = out.media
        used = sum(im.width * im.height for im in m.images) + sum(v.size // 3 for v in m.videos)
        return self.config.max_row_pixels - used

    def _decode_into(self, job: Job, ref: MediaRef, item: Fetched, out: Prepared) -> None:
        c = self.config
        budget = self._budget_left(out)
        if ref.kind == "image":
            width, height = self.decoded.sizes.get(item.digest, lambda: image_size(item.read()))
            if budget < width * height <= c.max_image_pixels:  # past the bound, decode names the bomb
                raise RowError(
                    "decode",
                    f"{width}x{height} image is over what is left of the row's budget of {c.max_row_pixels} "
                    "decoded pixels",
                )
            image = self.decoded.images.get((item.digest, c.max_image_pixels), lambda: self._decode(item))
            out.media.items.append(MediaItem("image", image, item.digest))
        elif ref.kind == "video":
            fps = job.video_fps or c.video_fps
            max_frames = job.video_max_frames or c.video_max_frames
            key = (item.digest, fps, c.video_min_frames, max_frames, self.frame_pixels, c.max_row_pixels)
            frames = self.decoded.frames.get(key, lambda: self._frames(item, fps, max_frames))
            if frames.shape[0] * frames.shape[1] * frames.shape[2] > budget:
                raise RowError(
                    "frames",
                    f"{frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} are over what is left "
                    f"of the row's budget of {c.max_row_pixels} decoded pixels",
                )
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
            out.media.items.append(MediaItem("video", frames, digest))
            if self._ffmpeg and not any(r.kind == "audio" for r in job.media):
                track = self.audio_tracks.get(item.digest, lambda: self._audio_track(item))
                if track:
                    out.media.items.append(MediaItem("audio", track, f"{item.digest}.track"))
        else:
            out.media.items.append(MediaItem("audio", str(self._on_disk(item)), item.digest))

    def _decode(self, item: Fetched) -> Image.Image:
        with self._cpu:
            image = decode_image(item.read(), self.config.max_image_pixels)
        image.info[IMAGE_DIGEST] = item.digest  # what the processor's memo keys on
        return image

    def _frames(self, item: Fetched, fps: float, max_frames: int) -> np.ndarray:
        c = self.config
        with self._cpu:
            return extract_frames(
                self._on_disk(item), fps, c.video_min_frames, max_frames, self.frame_pixels, c.max_row_pixels
            )

    def _on_disk(self, item: Fetched) -> Path:
        """Decoders that need a file get one: data-URL videos and audio are spilled to tmp."""
        if item.path is not None:
            return item.path
        path = self.tmp_dir / f"{item.digest}.{item.ref.kind}"
        if not path.exists():
            path.write_bytes(item.data or b"")
        return path

    def _audio_track(self, item: Fetched) -> str | None:
        """The video's sound as 16 kHz mono WAV, or None when it has none."""
        out = self.tmp_dir / f"{item.digest}.wav"
        if self._ffmpeg is None:
            return None
        cmd = [
            self._ffmpeg,
            "-nostdin",
            "-v",
            "error",
            "-y",
            "-i",
            str(self._on_disk(item)),
            "-vn",
            "-ac",
            "1",
            "-ar",
            "16000",
            "-f",
            "wav",
            str(out),
        ]
        with self._cpu:
            done = subprocess.run(cmd, capture_output=True, timeout=self.config.video_timeout)
        return str(out) if done.returncode == 0 and out.exists() and out.stat().st_size > 44 else None


class Prefetcher:
    """Jobs in order with their media resolving ahead in the pool, so I/O hides behind
    generation. Memory is bounded twice: at most `depth` rows ahead, and a row's media start
    only while the media decoded ahead, plus the rows in flight at the average row's size,
    stay under `max_bytes` (before any row is known, one row per fetch worker is in flight)."""

    def __init__(
        self,
        jobs: Iterator[Job],
        stage: MediaStage,
        pool: ThreadPoolExecutor,
        depth: int,
        max_bytes: int | None = None,
        stop: threading.Event | None = None,
    ):
        self.jobs, self.stage, self.pool, self.depth = jobs, stage, pool, depth
        self.max_bytes = max_bytes if max_bytes is not None else stage.config.window_media_bytes
        self.stop = stop or threading.Event()
        self.ahead: deque[tuple[Job, Future | None]] = deque()
        self._next: Job | None = None  # read from the job, waiting for room
        self._seen = self._seen_bytes = 0  # media rows taken and their bytes: the average row

    def start(self) -> None:
        self._fill()

    def held(self) -> tuple[int, int]:
        """(bytes held by the rows ahead: their decoded media and the undecoded media bytes
        the rows carry themselves; rows still resolving)."""
        futures = [f for _, f in self.ahead if f is not None]
        given = sum(_given_bytes(job) for job, _ in self.ahead)
        return given + sum(f.result().nbytes for f in futures if f.done()), sum(not f.done() for f in futures)

    def _room(self, held: int, pending: int) -> bool:
        if not (held or pending) or not self.ahead:
            return True  # one row always goes, however large
        if held > self.max_bytes:  # rows carrying their own bytes (binary cells, tar members)
            return False
        if not self._seen:
            return pending < self.stage.config.fetch_workers
        return held + (pending + 1) * self._seen_bytes / self._seen <= self.max_bytes

    def _fill(self) -> None:
        held, pending = self.held()
        while len(self.ahead) < self.depth:
            job = self._next if self._next is not None else next(self.jobs, None)
            if job is None:
                return
            needs_media = bool(job.media) and not job.error
            given = _given_bytes(job)
            if needs_media and not self._room(held + given, pending):
                self._next = job
                return
            self._next = None
            self.ahead.append((job, self.pool.submit(self.stage.resolve, job) if needs_media else None))
            pending += needs_media
            held += given

    def take(self, most: int, least: int, patience: float = 0.0) -> list[tuple[Job, Prepared | None]]:
        """Up to `most` rows and about `max_bytes` of media; past `least`, stop at the first row
        whose media are not ready — after waiting up to `patience` seconds from the call for
        it — so generation starts instead of waiting on the network. A stop request ends the
        wait at once."""
        window: list[tuple[Job, Prepared | None]] = []
        size = 0
        until = time.monotonic() + patience
        self._fill()
        while self.ahead and len(window) < most and not (window and size >= self.max_bytes):
            job, future = self.ahead[0]
            if len(window) >= least and future is not None and not future.done():
                if time.monotonic() >= until or self.stop.is_set():
                    break
                wait([future], timeout=min(0.05, max(until - time.monotonic(), 0.0)))
                continue
            while future is not None and not future.done():
                if self.stop.is_set():
                    return window
                wait([future], timeout=0.1)
            self.ahead.popleft()
            prepared = future.result() if future else None
            size += _given_bytes(job)
            if prepared is not None:
                self._seen += 1
                self._seen_bytes += prepared.nbytes + _given_bytes(job)
                size += prepared.nbytes
            window.append((job, prepared))
            if not self.ahead:  # more rows may fit the window (refilled once per take otherwise:
                self._fill()  # weighing the rows ahead for every row taken cost seconds a job)
        self._fill()
        return window


def _given_bytes(job: Job) -> int:
    """Media bytes a row carries itself (binary cells, tar members), held until it is written."""
    return sum(len(ref.source) for ref in job.media if isinstance(ref.source, bytes))

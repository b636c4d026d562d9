"""Media stages for one row: fetch each reference, then decode images or extract frames.

`MediaStage.resolve` runs in worker threads ahead of generation. Identical content is
decoded once per run: decoded images and frames are kept by content digest in bounded
memos, so rows sharing an image (by URL, path or data URL) share one decode.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import Memo
from .config import MediaConfig
from .decode import decode_image
from .errors import RowError
from .fetch import Fetched, Fetcher, describe
from .frames import extract_frames
from .records import Job, Media

__all__ = ["StageTimes", "Prepared", "MediaStage", "Prefetcher"]

_IMAGE_MEMORY = 512 * 2**20  # decoded pixels kept for reuse; a 448² image is 0.6 MB
_FRAMES_MEMORY = 1024 * 2**20


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


class MediaStage:
    """The run's media resolver: one fetcher, decode memos, a bound on CPU-heavy work."""

    def __init__(self, config: MediaConfig, base_dir: Path, tmp_dir: Path, audio_from_video: bool = False):
        self.config = config
        self.tmp_dir = tmp_dir
        self.fetcher = Fetcher(config, base_dir, tmp_dir)
        self.images: Memo[Any] = Memo(4096, _IMAGE_MEMORY, lambda im: im.width * im.height * 3)
        self.frames: Memo[Any] = Memo(256, _FRAMES_MEMORY, lambda a: a.nbytes)
        self.audio_tracks: Memo[str | None] = Memo(4096)
        self._cpu = threading.BoundedSemaphore(config.decode_workers)
        self._ffmpeg = shutil.which("ffmpeg") if audio_from_video else None

    def stats(self) -> dict[str, int]:
        f = self.fetcher
        return {
            "downloads": f.downloads,
            "download_bytes": f.download_bytes,
            "download_retries": f.retries,
            "url_reuses": f.url_reuses,
            "media_cache_hits": f.cache_hits,
            "image_decodes": self.images.misses,
            "image_decode_reuses": self.images.hits,
            "video_decodes": self.frames.misses,
            "video_decode_reuses": self.frames.hits,
        }

    def resolve(self, job: Job) -> Prepared:
        """Never raises for a row problem: the failure comes back in `Prepared.error`."""
        out = Prepared()
        try:
            self._resolve(job, out)
        except RowError as e:
            out.error = e
        return out

    def _resolve(self, job: Job, out: Prepared) -> None:
        c, times = self.config, out.times
        fps = job.video_fps or c.video_fps
        max_frames = job.video_max_frames or c.video_max_frames
        for ref in job.media:
            t0 = time.perf_counter()
            item = self.fetcher.fetch(ref)
            t1 = time.perf_counter()
            times.fetch_ms += (t1 - t0) * 1000
            if ref.kind == "image":
                out.media.images.append(self.images.get(item.digest, lambda i=item: self._decode(i)))
                out.media.image_digests.append(item.digest)
                times.decode_ms += (time.perf_counter() - t1) * 1000
            elif ref.kind == "video":
                key = (item.digest, fps, c.video_min_frames, max_frames)
                frames = self.frames.get(key, lambda i=item: self._frames(i, fps, max_frames))
                out.media.videos.append(frames)
                if self._ffmpeg and not any(r.kind == "audio" for r in job.media):
                    track = self.audio_tracks.get(item.digest, lambda i=item: self._audio_track(i))
                    if track:
                        out.media.audio.append(track)
                times.frames_ms += (time.perf_counter() - t1) * 1000
            else:
                out.media.audio.append(str(self._on_disk(item)))

    def _decode(self, item: Fetched):
        with self._cpu:
            return decode_image(item, self.config.max_image_pixels)

    def _frames(self, item: Fetched, fps: float, max_frames: int):
        with self._cpu:
            return extract_frames(
                self._on_disk(item), describe(item.ref.source), fps, self.config.video_min_frames, max_frames
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
        cmd = [self._ffmpeg, "-nostdin", "-v", "error", "-y", "-i", str(self._on_disk(item)),
               "-vn", "-ac", "1", "-ar", "16000", "-f", "wav", str(out)]  # fmt: skip
        with self._cpu:
            done = subprocess.run(cmd, capture_output=True, timeout=self.config.video_timeout)
        return str(out) if done.returncode == 0 and out.exists() and out.stat().st_size > 44 else None


class Prefetcher:
    """Jobs in order with their media resolving up to `depth` rows ahead in the pool, so I/O
    hides behind generation while at most `depth` rows of media sit in memory."""

    def __init__(self, jobs: Iterator[Job], stage: MediaStage, pool: ThreadPoolExecutor, depth: int):
        self.jobs, self.stage, self.pool, self.depth = jobs, stage, pool, depth
        self.ahead: deque[tuple[Job, Future | None]] = deque()
        self.exhausted = False

    def start(self) -> None:
        self._fill()

    def _fill(self) -> None:
        while not self.exhausted and len(self.ahead) < self.depth:
            job = next(self.jobs, None)
            if job is None:
                self.exhausted = True
                return
            needs_media = job.media and not job.error
            self.ahead.append((job, self.pool.submit(self.stage.resolve, job) if needs_media else None))

    def take(self, most: int, least: int) -> list[tuple[Job, Prepared | None]]:
        """Up to `most` rows; past `least`, stop at the first row whose media are not ready,
        so generation starts instead of waiting on the network."""
        window: list[tuple[Job, Prepared | None]] = []
        self._fill()
        while self.ahead and len(window) < most:
            job, future = self.ahead[0]
            if len(window) >= least and future is not None and not future.done():
                break
            self.ahead.popleft()
            window.append((job, future.result() if future else None))
            self._fill()
        return window

"""Media stages for one row: fetch each reference, then decode images or extract frames."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .config import MediaLimits
from .decode import decode_image
from .engine import Media
from .fetch import Fetched, describe, fetch
from .frames import extract_frames
from .records import Job

__all__ = ["StageTimes", "resolve_media"]


@dataclass(slots=True)
class StageTimes:
    fetch_ms: float = 0.0
    decode_ms: float = 0.0
    frames_ms: float = 0.0


def _on_disk(item: Fetched, tmp_dir: Path) -> Path:
    """Decoders that need a file get one: data-URL videos and audio are spilled to tmp_dir."""
    if item.path is not None:
        return item.path
    path = tmp_dir / f"{item.digest[:32]}.{item.ref.kind}"
    if not path.exists():
        path.write_bytes(item.data or b"")
    return path


def resolve_media(job: Job, base_dir: Path, limits: MediaLimits, tmp_dir: Path, times: StageTimes) -> Media:
    """Every media item of `job`, decoded; the first failure raises a RowError for its stage."""
    media = Media()
    for ref in job.media:
        t0 = time.perf_counter()
        item = fetch(ref, base_dir, limits)
        t1 = time.perf_counter()
        times.fetch_ms += (t1 - t0) * 1000
        if ref.kind == "image":
            media.images.append(decode_image(item, limits.max_image_pixels))
            times.decode_ms += (time.perf_counter() - t1) * 1000
        elif ref.kind == "video":
            frames = extract_frames(
                _on_disk(item, tmp_dir),
                describe(ref.source),
                limits.video_fps,
                limits.video_min_frames,
                limits.video_max_frames,
            )
            media.videos.append(frames)
            times.frames_ms += (time.perf_counter() - t1) * 1000
        else:
            media.audio.append(str(_on_disk(item, tmp_dir)))
    return media

"""Frames stage: evenly sampled RGB frames from a local video file, with OpenCV."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.errors import RowError
from .images import fit_pixels

__all__ = ["frame_indices", "extract_frames"]

_ASSUMED_FPS = 30.0  # what to believe when the container reports no frame rate
_MAX_COUNTED = 1_000_000  # frames counted by reading when the container does not say (raw MJPEG)


def frame_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Which frames to keep: `fps` per second of video within [min, max], never more than
    the video has, an even count of at least 2, spread evenly from first to last."""
    if total <= 0:
        return []
    duration = total / (video_fps if video_fps > 0 else _ASSUMED_FPS)
    count = min(max(int(duration * fps), min_frames), max_frames, total)
    count = max(2, count - count % 2)
    return [int(round(x)) for x in np.linspace(0, total - 1, count)]


def _open(path: Path):
    import cv2

    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        cap.release()
        raise RowError("frames", "not a video OpenCV can open")
    return cap


def _frame_count(path: Path) -> int:
    """The container's frame count, or the frames counted by reading when it reports none
    (a raw MJPEG stream reports a negative count)."""
    import cv2

    cap = _open(path)
    try:
        total = cap.get(cv2.CAP_PROP_FRAME_COUNT)
        if 0 < total < _MAX_COUNTED:
            return int(total)
        total = 0
        while total < _MAX_COUNTED and cap.grab():
            total += 1
        return total
    finally:
        cap.release()


def extract_frames(
    path: Path,
    fps: float,
    min_frames: int,
    max_frames: int,
    max_pixels: int | None = None,
    budget: int | None = None,
) -> np.ndarray:
    """Frames as a (T, H, W, 3) uint8 RGB array.

    Frames larger than `max_pixels` (what the model takes) are downscaled as they are read,
    into one array allocated once, so a long 4K clip never holds its full-size frames;
    `budget` bounds the pixels of all kept frames together. Reads forward with grab() and
    decodes only the kept frames: sequential grabbing beats a seek per frame on long-GOP
    codecs, where each seek decodes from a keyframe.
    """
    import cv2

    total = _frame_count(path)
    cap = _open(path)
    try:
        video_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        wanted = frame_indices(total, video_fps, fps, min_frames, max_frames)
        if not wanted:
            raise RowError("frames", "the video has no frames")
        out: np.ndarray | None = None
        kept = 0
        position = 0
        for target in wanted:
            if target == position - 1 and out is not None and kept:  # repeated index (short video)
                out[kept] = out[kept - 1]
                kept += 1
                continue
            while position <= target:
                if not cap.grab():
                    break
                position += 1
            if position <= target:
                break  # the container over-reported its frame count
            ok, bgr = cap.retrieve()
            if not ok or bgr is None or bgr.ndim != 3:
                raise RowError("frames", f"cannot decode frame {target}")
            if out is None:
                h, w = bgr.shape[:2]
                w, h = fit_pixels(w, h, max_pixels) if max_pixels else (w, h)
                if budget is not None and len(wanted) * w * h > budget:
                    raise RowError(
                        "frames", f"{len(wanted)} frames of {w}x{h} exceed the row budget of {budget} pixels"
                    )
                out = np.empty((len(wanted), h, w, 3), np.uint8)
            if bgr.shape[:2] != out.shape[1:3]:
                bgr = cv2.resize(bgr, (out.shape[2], out.shape[1]), interpolation=cv2.INTER_AREA)
            cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=out[kept])
            kept += 1
    finally:
        cap.release()
    if out is None or kept < 2:
        raise RowError("frames", "the video has no decodable frames")
    return out[: kept - kept % 2]

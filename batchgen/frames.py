"""Frames stage: evenly sampled RGB frames from a local video file, with OpenCV."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import RowError

__all__ = ["frame_indices", "extract_frames"]

_ASSUMED_FPS = 30.0  # what to believe when the container reports no frame rate


def frame_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Which frames to keep: `fps` per second of video within [min, max], never more than
    the video has, an even count of at least 2, spread evenly from first to last."""
    if total <= 0:
        return []
    duration = total / (video_fps if video_fps > 0 else _ASSUMED_FPS)
    count = min(max(int(duration * fps), min_frames), max_frames, total)
    count = max(2, count - count % 2)
    return [int(round(x)) for x in np.linspace(0, total - 1, count)]


def extract_frames(path: Path, name: str, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Frames as a (T, H, W, 3) uint8 RGB array.

    Reads forward with grab() and decodes only the kept frames: sequential grabbing
    beats a seek per frame on long-GOP codecs, where each seek decodes from a keyframe.
    """
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise RowError("frames", f"{name}: not a video OpenCV can open")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        video_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        wanted = frame_indices(total, video_fps, fps, min_frames, max_frames)
        if not wanted:
            raise RowError("frames", f"{name}: the video has no frames")
        frames: list[np.ndarray] = []
        last = None
        position = 0
        for target in wanted:
            if target == position - 1 and last is not None:  # repeated index (short video)
                frames.append(last)
                continue
            while position <= target:
                if not cap.grab():
                    break
                position += 1
            if position <= target:
                break  # the container over-reported its frame count
            ok, bgr = cap.retrieve()
            if not ok:
                raise RowError("frames", f"{name}: cannot decode frame {target}")
            last = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            frames.append(last)
    finally:
        cap.release()
    if len(frames) < 2:
        raise RowError("frames", f"{name}: the video has no decodable frames")
    if len(frames) % 2:
        frames = frames[:-1]
    return np.stack(frames)

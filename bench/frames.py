"""Frame extraction: reading forward (grab, decode only kept frames) against a seek per frame.

python bench/frames.py     # the sample video, then a 20 s 640x360 clip made on the fly
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgen.media.frames import extract_frames, frame_indices  # noqa: E402


def seek_each(path: Path, fps: float = 2.0) -> np.ndarray:
    cap = cv2.VideoCapture(str(path))
    total, video_fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS)
    frames = []
    for i in frame_indices(total, video_fps, fps, 4, 128):
        cap.set(cv2.CAP_PROP_POS_FRAMES, i)
        ok, bgr = cap.read()
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    cap.release()
    return np.stack(frames)


def make_clip(path: Path, seconds: int = 20, fps: int = 30) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (640, 360))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (360, 640, 3), dtype=np.uint8)
    for i in range(seconds * fps):
        writer.write(np.roll(base, i * 4, axis=1))
    writer.release()


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def compare(path: Path) -> None:
    forward = extract_frames(path, 2.0, 4, 128)
    seeked = seek_each(path)
    same = forward.shape == seeked.shape and bool((forward == seeked).all())
    t_forward = best_of(lambda: extract_frames(path, 2.0, 4, 128))
    t_seek = best_of(lambda: seek_each(path))
    print(
        f"{path.name}: {len(forward)} frames; forward {t_forward * 1000:.1f} ms, "
        f"seek {t_seek * 1000:.1f} ms, seek/forward {t_seek / t_forward:.2f}, identical frames: {same}"
    )


if __name__ == "__main__":
    compare(ROOT / "sample_data" / "media" / "moving_dot.mp4")
    with tempfile.TemporaryDirectory() as tmp:
        clip = Path(tmp) / "clip_640x360_20s.mp4"
        make_clip(clip)
        compare(clip)

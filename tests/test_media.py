"""The media stage's memory bounds on real files: frames kept at the model's size, decoded
media ahead of generation under a byte bound."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
from PIL import Image

from batchgen.config import MediaConfig
from batchgen.media import MediaStage, Prefetcher
from batchgen.records import Job, MediaRef


def test_large_frames_are_downscaled_as_they_are_read(tmp_path):
    path = tmp_path / "big.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 8, (1024, 512))
    for i in range(16):
        writer.write(np.full((512, 1024, 3), i * 10, np.uint8))
    writer.release()
    stage = MediaStage(MediaConfig(), tmp_path, tmp_path, model_pixels=3136)
    prepared = stage.resolve(Job(index=0, id=0, media=[MediaRef("video", "big.avi")]))
    assert prepared.error is None
    (frames,) = prepared.media.videos
    assert frames.shape == (4, 39, 79, 3)  # 2:1 kept, at most 3136 pixels a frame
    assert frames[-1].mean() > frames[0].mean()  # the last frame is the brightest, as written


def test_media_ahead_of_generation_stay_under_the_byte_bound(tmp_path):
    for i in range(12):
        Image.new("RGB", (256, 256), (i * 20, 0, 0)).save(tmp_path / f"{i}.png")
    row = 256 * 256 * 3
    jobs = [Job(index=i, id=i, media=[MediaRef("image", f"{i}.png")]) for i in range(12)]
    stage = MediaStage(MediaConfig(fetch_workers=2), tmp_path, tmp_path)
    with ThreadPoolExecutor(2) as pool:
        prefetcher = Prefetcher(iter(jobs), stage, pool, depth=256, max_bytes=3 * row)
        prefetcher.start()
        assert len(prefetcher.ahead) == 2  # nothing known yet: a row per worker
        taken = []
        while window := prefetcher.take(most=256, least=1):
            assert sum(p.nbytes for _, p in window) <= 3 * row
            time.sleep(0.05)  # generation: the rows ahead finish meanwhile
            held, pending = prefetcher.held()
            assert held + pending * row <= 3 * row
            taken += [job.id for job, _ in window]
    assert taken == list(range(12))

"""The media stage's memory bounds on real files: frames kept at the model's size, decoded
media ahead of generation under a byte bound."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
from PIL import Image

from batchgen.core.records import IMAGE_DIGEST, Job, MediaRef
from batchgen.core.settings import MediaConfig
from batchgen.media.resolve import MediaStage, Prefetcher


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


def test_bytes_rows_carry_count_in_the_bound_before_they_decode(tmp_path):
    """Rows holding their media as bytes (binary cells, tar members) weigh what they carry,
    even while nothing is decoded yet and even when they fail: no more than the bound is
    read ahead, however many fetch workers wait."""
    carried = 2**20
    jobs = [Job(index=i, id=i, media=[MediaRef("image", bytes([i]) * carried)]) for i in range(12)]
    stage = MediaStage(MediaConfig(fetch_workers=16, image_bytes=1000), tmp_path, tmp_path)
    with ThreadPoolExecutor(2) as pool:
        prefetcher = Prefetcher(iter(jobs), stage, pool, depth=256, max_bytes=3 * carried)
        prefetcher.start()
        assert len(prefetcher.ahead) == 3  # not one a worker: the bytes already read count
        taken = []
        while window := prefetcher.take(most=256, least=1):
            assert len(prefetcher.ahead) <= 4
            for _, prepared in window:
                assert "bytes is over the image cap (1,000 bytes)" in prepared.error.message
            taken += [job.id for job, _ in window]
    assert taken == list(range(12))


def test_a_rows_media_are_one_list_of_records_each_image_tagged_with_its_content_digest(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    Image.new("RGB", (8, 8), "red").save(tmp_path / "copy.png")  # the same bytes under another name
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "b.png")
    stage = MediaStage(MediaConfig(), tmp_path, tmp_path)
    refs = [MediaRef("image", name) for name in ("a.png", "b.png", "copy.png")]
    media = stage.resolve(Job(index=0, id=0, media=refs)).media
    assert [m.kind for m in media.items] == ["image"] * 3 and media.images == [m.payload for m in media.items]
    digests = media.digests("image")
    assert digests[0] == digests[2] != digests[1] and media.images[0] is media.images[2]  # decoded once
    assert [im.info[IMAGE_DIGEST] for im in media.images] == digests  # what the processor's memo keys on

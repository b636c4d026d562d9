"""Decode and frames stages on real files; the fetch stage has test_fetch.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import MEDIA
from PIL import Image

from batchgen.config import MediaConfig
from batchgen.decode import decode_image
from batchgen.errors import RowError
from batchgen.fetch import Fetched, Fetcher
from batchgen.frames import extract_frames, frame_indices
from batchgen.records import MediaRef


def _image_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _item(data: bytes) -> Fetched:
    return Fetched(MediaRef("image", "test.img"), data=data)


def test_exif_rotated_jpeg_comes_out_upright():
    item = Fetcher(MediaConfig(), MEDIA, MEDIA).fetch(MediaRef("image", "green_triangle_rotated.jpg"))
    stored = Image.open(io.BytesIO(item.read()))
    img = decode_image(item, 10**8)
    assert stored.getexif().get(0x0112) == 6
    # Upright, the triangle's apex points up: its green pixels centre on the vertical
    # axis, two thirds of the way down (stored sideways, they centre on the horizontal one).
    a = np.asarray(img).astype(int)
    ys, xs = np.nonzero((a[..., 1] > 100) & (a[..., 0] < 100))
    assert abs(xs.mean() - 48) < 3 and ys.mean() > 54


def test_truncated_jpeg_is_a_decode_error():
    data = _image_bytes(Image.new("RGB", (64, 64), "red"), "JPEG")
    with pytest.raises(RowError) as e:
        decode_image(_item(data[: len(data) // 2]), 10**8)
    assert e.value.stage == "decode" and "test.img" in e.value.message


def test_decompression_bomb_is_refused_from_the_header():
    data = _image_bytes(Image.new("1", (5000, 5000)), "PNG")  # tiny file, 25 Mpx
    with pytest.raises(RowError) as e:
        decode_image(_item(data), max_pixels=1_000_000)
    assert e.value.stage == "decode" and "5000x5000" in e.value.message


def test_not_an_image_is_a_decode_error():
    with pytest.raises(RowError, match="not an image"):
        decode_image(_item(b"<html>hello</html>"), 10**8)


def test_animated_gif_gives_its_first_frame_in_rgb():
    frames = [Image.new("P", (8, 8), i) for i in (1, 2, 3)]
    data = _image_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:])
    img = decode_image(_item(data), 10**8)
    assert img.mode == "RGB" and img.size == (8, 8)


def test_frame_indices_of_the_sample_video():
    # 24 frames at 8 fps = 3 s → 6 frames at 2 fps, evenly spaced from first to last.
    assert frame_indices(24, 8.0, 2.0, 4, 128) == [0, 5, 9, 14, 18, 23]
    assert frame_indices(24, 8.0, 4.0, 4, 128) == [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]
    assert frame_indices(24, 8.0, 4.0, 4, 8) == [0, 3, 7, 10, 13, 16, 20, 23]


def test_frame_indices_rules():
    assert len(frame_indices(300, 30.0, 2.0, 4, 128)) == 20  # 10 s at 2 fps
    assert len(frame_indices(30, 30.0, 2.0, 4, 128)) == 4  # 1 s → raised to the minimum
    assert len(frame_indices(30 * 600, 30.0, 2.0, 4, 128)) == 128  # capped
    assert len(frame_indices(3, 30.0, 2.0, 4, 128)) == 2  # never more than the video has, even
    assert len(frame_indices(45, 30.0, 2.0, 3, 128)) == 2  # 1.5 s → 3 → rounded down to even
    assert frame_indices(90, 0.0, 2.0, 4, 128) == [0, 18, 36, 53, 71, 89]  # no fps: assume 30 → 3 s
    assert frame_indices(0, 30.0, 2.0, 4, 128) == []


def test_sample_video_frames_are_rgb_at_the_expected_indices():
    frames = extract_frames(MEDIA / "moving_dot.mp4", "moving_dot.mp4", 2.0, 4, 128)
    assert frames.shape == (6, 64, 64, 3) and frames.dtype == np.uint8
    # The dot is red in RGB (written as BGR red) and moves right.
    xs = [np.argwhere((f[..., 0] > 150) & (f[..., 2] < 100))[:, 1].mean() for f in frames]
    assert xs == sorted(xs) and xs[-1] - xs[0] > 30


def test_non_video_is_a_frames_error(tmp_path):
    bad = tmp_path / "random.mp4"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(RowError) as e:
        extract_frames(bad, "random.mp4", 2.0, 4, 128)
    assert e.value.stage == "frames"
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(RowError, match="frames|video"):
        extract_frames(empty, "empty.mp4", 2.0, 4, 128)

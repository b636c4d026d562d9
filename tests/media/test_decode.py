"""Decode stage on real image bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import MEDIA
from PIL import Image

from batchgen.core.errors import RowError
from batchgen.core.records import MediaRef
from batchgen.core.settings import MediaConfig
from batchgen.media.fetch import Fetcher
from batchgen.media.images import decode_image


def _image_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_exif_rotated_jpeg_comes_out_upright():
    item = Fetcher(MediaConfig(), MEDIA, MEDIA).fetch(MediaRef("image", "green_triangle_rotated.jpg"))
    stored = Image.open(io.BytesIO(item.read()))
    img = decode_image(item.read(), 10**8)
    assert stored.getexif().get(0x0112) == 6
    # Upright, the triangle's apex points up: its green pixels centre on the vertical
    # axis, two thirds of the way down (stored sideways, they centre on the horizontal one).
    a = np.asarray(img).astype(int)
    ys, xs = np.nonzero((a[..., 1] > 100) & (a[..., 0] < 100))
    assert abs(xs.mean() - 48) < 3 and ys.mean() > 54


def test_truncated_jpeg_is_a_decode_error():
    data = _image_bytes(Image.new("RGB", (64, 64), "red"), "JPEG")
    with pytest.raises(RowError) as e:
        decode_image(data[: len(data) // 2], 10**8)
    assert e.value.stage == "decode" and "corrupt image" in e.value.message


def test_decompression_bomb_is_refused_from_the_header():
    data = _image_bytes(Image.new("1", (5000, 5000)), "PNG")  # tiny file, 25 Mpx
    with pytest.raises(RowError) as e:
        decode_image(data, max_pixels=1_000_000)
    assert e.value.stage == "decode" and "5000x5000" in e.value.message


def test_not_an_image_is_a_decode_error():
    with pytest.raises(RowError, match="not an image"):
        decode_image(b"<html>hello</html>", 10**8)


def test_animated_gif_gives_its_first_frame_in_rgb():
    frames = [Image.new("P", (8, 8), i) for i in (1, 2, 3)]
    data = _image_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:])
    img = decode_image(data, 10**8)
    assert img.mode == "RGB" and img.size == (8, 8)

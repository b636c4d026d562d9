"""Decode stage: bytes to an upright RGB Pillow image, refusing what is not one."""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import RowError
from .fetch import Fetched, describe

__all__ = ["decode_image"]


def decode_image(item: Fetched, max_pixels: int) -> Image.Image:
    """Verify, orient (EXIF), take the first frame of animations, convert to RGB.

    The pixel bound is checked from the header, before any pixel is decoded, so a
    decompression bomb costs nothing but its header.
    """
    name = describe(item.ref.source)
    data = item.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as probe:
                width, height = probe.size
                if width * height > max_pixels:
                    raise RowError(
                        "decode", f"{name}: {width}x{height} image is over the {max_pixels}-pixel bound"
                    )
                probe.verify()
            with Image.open(io.BytesIO(data)) as img:
                img.seek(0)  # animated GIF/WebP/PNG: the first frame
                upright = ImageOps.exif_transpose(img)
                rgb = upright.convert("RGB")
                rgb.load()
        except RowError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise RowError("decode", f"{name}: decompression bomb ({e})") from e
        except UnidentifiedImageError:
            raise RowError("decode", f"{name}: not an image Pillow can read") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise RowError("decode", f"{name}: corrupt image ({e})") from e
    return rgb

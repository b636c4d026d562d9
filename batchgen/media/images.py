"""Decode stage: bytes to an upright RGB Pillow image, refusing what is not one."""

from __future__ import annotations

import io
import math
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from ..core.errors import RowError, short

__all__ = ["IMAGE_FORMATS", "decode_image", "image_size", "fit_pixels"]

# The formats Pillow may open. Others are refused unread: EPS runs Ghostscript on the file,
# and rarely used plugins (DDS, PCX, ...) are where fuzzed files find crashes.
IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")  # MPO comes in as JPEG


def fit_pixels(width: int, height: int, most: int) -> tuple[int, int]:
    """The largest size of the same aspect with at most `most` pixels (never upscaled)."""
    if width * height <= most:
        return width, height
    scale = math.sqrt(most / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def image_size(data: bytes) -> tuple[int, int]:
    """Width and height from the header alone; a RowError for what is not an accepted image."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:
            return probe.size
    except UnidentifiedImageError:
        raise RowError("decode", f"not an image in an accepted format ({', '.join(IMAGE_FORMATS)})") from None
    except Exception as e:  # noqa: BLE001 - a hostile header can raise anything
        raise RowError("decode", f"corrupt image ({type(e).__name__}: {short(e)})") from None


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Verify, orient (EXIF), take the first frame of animations, convert to RGB.

    The pixel bound is checked from the header, before any pixel is decoded, so a
    decompression bomb costs nothing but its header. Messages do not name the image: the
    caller, who knows which reference of which row it is, does.
    """
    width, height = image_size(data)
    if width * height > max_pixels:
        raise RowError("decode", f"{width}x{height} image is over the {max_pixels}-pixel bound")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:
                probe.verify()
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                img.seek(0)  # animated GIF/WebP/PNG: the first frame
                upright = ImageOps.exif_transpose(img)
                rgb = upright.convert("RGB")
                rgb.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise RowError("decode", f"decompression bomb ({e})") from e
        except UnidentifiedImageError:
            raise RowError("decode", "not an image Pillow can read") from None
        except Exception as e:  # noqa: BLE001 - plugins meet fuzzed files with any exception
            raise RowError("decode", f"corrupt image ({type(e).__name__}: {short(e)})") from None
    return rgb

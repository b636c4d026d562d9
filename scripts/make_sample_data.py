"""Rebuild sample_data/: the tiny checkpoints, a few small media files and the job files.

Deterministic: running it twice gives the same files. `python scripts/make_sample_data.py`
"""

from __future__ import annotations

import base64
import io
import json
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from batchgen.tools.tiny.builder import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_shapes_captioner import QUESTIONS, draw  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "sample_data"


def shape_image(shape: str, colour: str, size: int = 96, background: str = "white") -> Image.Image:
    img = Image.new("RGB", (size, size), background)
    d = ImageDraw.Draw(img)
    m = size // 5
    box = (m, m, size - m, size - m)
    if shape == "circle":
        d.ellipse(box, fill=colour)
    elif shape == "square":
        d.rectangle(box, fill=colour)
    else:
        d.polygon([(size // 2, m), (size - m, size - m), (m, size - m)], fill=colour)
    return img


def write_media(media: Path) -> None:
    media.mkdir(parents=True, exist_ok=True)
    shape_image("circle", "red").save(media / "red_circle.png")
    shape_image("square", "blue").save(media / "blue_square.webp", lossless=True)
    # Stored sideways with EXIF orientation 6 (rotate 90° clockwise to view upright).
    upright = shape_image("triangle", "green", background="yellow")
    exif = Image.Exif()
    exif[0x0112] = 6
    upright.rotate(90, expand=True).save(media / "green_triangle_rotated.jpg", exif=exif, quality=90)
    write_video(media / "moving_dot.mp4")


def write_video(path: Path, frames: int = 24, fps: float = 8.0, size: int = 64) -> None:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    for i in range(frames):
        frame = np.full((size, size, 3), 255, np.uint8)
        x = 8 + i * (size - 16) // max(1, frames - 1)
        cv2.circle(frame, (x, size // 2), 6, (0, 0, 255), -1)  # BGR red
        writer.write(frame)
    writer.release()


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SHAPES_SEED = 1234  # the training draws with seeds 0-2: these images are new to the model


def shape_rows() -> list[dict]:
    """Six unseen shapes, three questions each, with the right answer in `expected`."""
    rng = random.Random(SHAPES_SEED)
    (ROOT / "shapes").mkdir(exist_ok=True)
    picks = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("star", "yellow"),
             ("circle", "white"), ("star", "blue")]  # fmt: skip
    rows = []
    for shape, colour in picks:
        name = f"shapes/{colour}_{shape}.png"
        draw(shape, colour, rng).save(ROOT / name)
        for question, answer in QUESTIONS.items():
            rows.append({"id": f"{colour}-{shape}-{len(rows) % 3}", "image": name, "prompt": question,
                         "expected": answer(shape, colour)})  # fmt: skip
    return rows


def write_jobs() -> None:
    rows = [
        {"id": "text-1", "prompt": "Write a short poem about the sea.", "source": "demo"},
        {"id": "text-2", "system": "You are brief.", "prompt": "Name three colours.", "source": "demo"},
        {"id": "text-3", "messages": [{"role": "user", "content": "Hello! What is a batch job?"}]},
        {"id": "img-1", "image": "media/red_circle.png", "prompt": "What shape is this?", "source": "demo"},
        {"id": "img-2", "image": "media/red_circle.png", "prompt": "What colour is the shape?"},
        {"id": "img-3", "image": "media/green_triangle_rotated.jpg", "prompt": "Describe the image."},
        {
            "id": "img-4",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "media/blue_square.webp"}},
                        {"type": "text", "text": "What colour is the shape?"},
                    ],
                }
            ],
        },
        {"id": "img-5", "image": data_url(shape_image("circle", "blue")), "prompt": "What shape is this?"},
        {"id": "video-1", "video": "media/moving_dot.mp4", "prompt": "Where does the dot move?"},
    ]
    shapes = shape_rows()
    rows = rows[:3] + shapes + rows[3:]
    # The shapes job on its own, its rows shuffled so that no two rows on one image are adjacent.
    order = [k * 3 + q for q in range(3) for k in range(len(shapes) // 3)]
    with (ROOT / "shapes.jsonl").open("w") as f:
        for i in order:
            f.write(json.dumps(shapes[i]) + "\n")
    with (ROOT / "jobs.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    # sample_data/models/shapes-vlm comes from scripts/train_shapes_captioner.py (15 minutes).
    make_tiny_model(ROOT / "models" / "tiny-vlm", kind="vlm")
    make_tiny_model(ROOT / "models" / "tiny-lm", kind="lm")
    write_media(ROOT / "media")
    write_jobs()
    print(f"wrote {ROOT}")

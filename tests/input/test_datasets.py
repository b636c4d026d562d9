"""Dataset-shaped jobs: images as bytes and Hugging Face structs, img2dataset shards with mapped
columns, mistakes in the mapping stopped before any work. The shapes captioner is the oracle:
right answers prove each row got its own image."""

from __future__ import annotations

import io
import json
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import MEDIA, MODELS, ROOT, read, run_cli

sys.path.insert(0, str(ROOT / "scripts"))

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = str(MODELS / "shapes-vlm")
GREEDY = ("--model", CAPTIONER, "--temperature", "0", "--max-tokens", "6")


def _pictures(folder, n, seed=3):
    """n shapes pictures: (JPEG bytes, shape, file name of the same picture as a PNG)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        shape = ("circle", "square", "triangle", "star")[k % 4]
        image = shapes.draw(shape, rng.choice(["red", "blue", "green", "yellow", "white"]), rng)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=95)
        image.save(folder / f"pic{k}.png")
        out.append((buf.getvalue(), shape, f"pic{k}.png"))
    return out


def _right(rows, answers):
    return sum(r["generated_text"].strip() == a for r, a in zip(rows, answers, strict=True)) / len(answers)


@pytest.mark.parametrize("form", ["bytes", "struct-bytes", "struct-path"])
def test_images_as_bytes_or_hugging_face_structs_are_answered(tmp_path, form):
    pictures = _pictures(tmp_path, 12)
    cells = {
        "bytes": [jpg for jpg, _, _ in pictures],
        "struct-bytes": [{"bytes": jpg, "path": "ignored.jpg"} for jpg, _, _ in pictures],  # bytes first
        "struct-path": [{"bytes": None, "path": png} for _, _, png in pictures],  # relative to the job
    }[form]
    cells += cells[:4]  # the first four pictures asked again: decoded once
    answers = [shape for _, shape, _ in pictures] + [shape for _, shape, _ in pictures[:4]]
    table = pa.table({"image": cells, "prompt": ["What shape is this?"] * len(cells), "n": range(len(cells))})
    pq.write_table(table, tmp_path / "job.parquet")
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(tmp_path / "job.parquet"), "-o", str(out), *GREEDY)
    assert code == 0, output
    rows = read(out)
    assert _right(rows, answers) >= 0.9, [
        (r["generated_text"], a) for r, a in zip(rows, answers, strict=True)
    ]
    stats = json.loads((tmp_path / "out.parquet.stats.json").read_text())
    assert stats["media"]["image_decodes"] == 12 and stats["media"]["downloads"] == 0
    if form == "struct-path":  # paths only: carried as they are
        assert rows[0]["image"] == {"bytes": None, "path": "pic0.png"} and not stats["dropped_columns"]
    else:  # no image bytes in the output
        assert "image" not in rows[0] and rows[0]["n"] == 0 and stats["dropped_columns"] == ["image"]
        assert "not copied to the output: image (binary; --keep-columns to keep)" in output


def test_an_img2dataset_shard_runs_with_mapped_columns(tmp_path):
    pictures = _pictures(tmp_path, 16)
    table = pa.table({
        "key": [f"{k:09d}" for k in range(16)],
        "jpg": [jpg for jpg, _, _ in pictures],
        # The tiny captioner knows three questions only: the text column holds one of them.
        "caption": ["What shape is this?"] * 16,
        "url": [f"https://example.com/{k}.jpg" for k in range(16)],
        "width": [56] * 16,
    })  # fmt: skip
    job = tmp_path / "00000.parquet"
    pq.write_table(table, job)
    mapping = ("--image-column", "jpg", "--id-column", "key")
    template = ("--prompt-template", "{caption}")
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), *GREEDY, *mapping, *template)
    assert code == 0, output
    rows = read(out)
    assert [r["id"] for r in rows] == table.column("key").to_pylist()
    assert _right(rows, [shape for _, shape, _ in pictures]) >= 0.9
    assert "jpg" not in rows[0] and rows[0]["caption"] == "What shape is this?" and rows[0]["width"] == 56
    assert "warning" not in output  # the media column is mapped

    kept = tmp_path / "kept.parquet"
    code, output = run_cli("run", str(job), "-o", str(kept), *GREEDY, *mapping, *template,
                           "--keep-columns", "jpg", "--drop-columns", "url")  # fmt: skip
    assert code == 0, output
    rows = read(kept)
    assert [r["jpg"] for r in rows] == table.column("jpg").to_pylist() and "url" not in rows[0]

    preset = tmp_path / "i2d.yaml"  # the same mapping from a preset
    preset.write_text("columns: {image: jpg, id: key}\n")
    from_preset = tmp_path / "preset.parquet"
    code, output = run_cli(
        "run", str(job), "-o", str(from_preset), *GREEDY, "--config", str(preset), *template
    )
    assert code == 0, output
    assert [r["generated_text"] for r in read(from_preset)] == [r["generated_text"] for r in read(out)]

    code, output = run_cli("validate", str(job), *mapping, *template)
    assert code == 0, output


def test_a_mapping_naming_a_missing_column_stops_the_run_and_lists_the_columns(tmp_path):
    table = pa.table({"key": ["a", "b"], "jpg": [b"\xff\xd8", b"\xff\xd8"], "caption": ["x", "y"]})
    job = tmp_path / "shard.parquet"
    pq.write_table(table, job)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), *GREEDY, "--image-column", "img",
                           "--id-column", "key", "--prompt-template", "{caption}")  # fmt: skip
    assert code == 2
    assert "no column --image-column 'img'; its columns: key, jpg, caption" in output
    assert not out.exists() and not (tmp_path / "out.parquet.partial").exists()
    code, output = run_cli("validate", str(job), "--image-column", "img")
    assert code == 2 and "no column --image-column 'img'" in output
    code, output = run_cli("run", str(job), "-o", str(out), *GREEDY, "--prompt-column", "caption",
                           "--prompt-template", "{caption}")  # fmt: skip
    assert code == 2 and "not both" in output


def test_a_row_without_media_beside_a_media_column_is_warned_about(tmp_path):
    """The img2dataset shard run without --image-column: its rows are text rows, and the
    summary says which column looks like their images and which flag maps it."""
    pictures = _pictures(tmp_path, 3)
    table = pa.table({"key": ["a", "b", "c"], "jpg": [jpg for jpg, _, _ in pictures], "caption": ["x"] * 3})
    job = tmp_path / "shard.parquet"
    pq.write_table(table, job)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), *GREEDY, "--text-model", str(MODELS / "tiny-lm"),
                           "--prompt-template", "Describe {caption}", "--max-tokens", "2")  # fmt: skip
    assert code == 0, output
    assert (
        "warning: 3 rows without media beside column 'jpg', which looks like media "
        "(--image-column jpg or --video-column jpg to use it)" in output
    )
    stats = json.loads((tmp_path / "out.parquet.stats.json").read_text())
    assert stats["unused_media"] == {"jpg": 3}


def test_media_bytes_inside_messages_and_a_video_as_bytes(tmp_path):
    pictures = _pictures(tmp_path, 2)
    part = {"type": None, "text": None, "image": None}
    messages = [
        [{"role": "user", "content": [{**part, "type": "image", "image": jpg},
                                      {**part, "type": "text", "text": "What shape is this?"}]}]
        for jpg, _, _ in pictures
    ]  # fmt: skip
    pq.write_table(pa.table({"id": ["m0", "m1"], "messages": messages}), tmp_path / "messages.parquet")
    out = tmp_path / "messages-out.parquet"
    code, output = run_cli("run", str(tmp_path / "messages.parquet"), "-o", str(out), *GREEDY)
    assert code == 0, output
    assert _right(read(out), [shape for _, shape, _ in pictures]) == 1.0

    clip = (MEDIA / "moving_dot.mp4").read_bytes()
    table = pa.table({"id": ["v", "bad"], "video": [clip, clip[:500]], "prompt": ["What moves?"] * 2})
    pq.write_table(table, tmp_path / "video.parquet")
    out = tmp_path / "video-out.parquet"
    code, output = run_cli("run", str(tmp_path / "video.parquet"), "-o", str(out), "--model",
                           str(MODELS / "tiny-vlm"), "--max-tokens", "2")  # fmt: skip
    ok, bad = read(out)
    assert ok["status"] == "ok" and ok["frames_ms"] > 0 and ok["fetch_ms"] < 50
    assert bad["status"] == "error" and bad["error_stage"] == "frames"
    assert bad["error"].startswith("500 bytes from the row: ")


def test_hostile_bytes_and_structs_are_row_errors(tmp_path):
    (jpg, shape, _), *_ = _pictures(tmp_path, 1)
    table = pa.table({
        "id": ["good", "garbage", "empty", "no-struct"],
        "image": [{"bytes": jpg, "path": None}, {"bytes": b"not an image", "path": None},
                  {"bytes": b"", "path": None}, {"bytes": None, "path": None}],
        "prompt": ["What shape is this?"] * 4,
    })  # fmt: skip
    pq.write_table(table, tmp_path / "job.parquet")
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(tmp_path / "job.parquet"), "-o", str(out), *GREEDY)
    assert code == 1, output
    good, garbage, empty, none = read(out)
    assert good["generated_text"].strip() == shape
    assert garbage["error_stage"] == "decode" and garbage["error"].startswith("12 bytes from the row: ")
    for row in (empty, none):
        assert row["error_stage"] == "read" and "image: expected a URL, path, data URL, bytes" in row["error"]

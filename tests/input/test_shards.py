"""Jobs of many files: a folder or glob of shards read as one job, img2dataset's WebDataset tars."""

from __future__ import annotations

import io
import json
import random
import sys
import tarfile

import pytest
from conftest import MODELS, ROOT, read, run_cli, write_jsonl

from batchgen.input.read import iter_rows, scan

sys.path.insert(0, str(ROOT / "scripts"))

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = str(MODELS / "shapes-vlm")
QUICK = ("--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"), "--temperature", "0",
         "--max-tokens", "2", "-q")  # fmt: skip


def _key(rows):
    return [(r.index, r.line, r.file, r.value, r.error) for r in rows]


def _folder(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(3):
        rows = [{"id": f"s{k}-{i}", "prompt": f"Item {i} of shard {k}."} for i in range(70)]
        write_jsonl(shards / f"{k:05d}.jsonl", rows if k != 1 else [*rows[:2], "{broken", *rows[2:]])
    (shards / "_stats.json").write_text("{}")  # img2dataset's own files: not rows
    (shards / ".hidden.jsonl").write_text('{"id": "hidden"}\n')
    return shards


@pytest.mark.slow  # 210 rows in five runs
def test_a_folder_of_shards_is_one_job_in_shard_order(tmp_path, scripted):
    shards = _folder(tmp_path)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(shards), "-o", str(out), *QUICK)
    assert code == 1, output  # the broken line
    rows = read(out)
    assert len(rows) == 211 and rows[0]["id"] == "s0-0" and rows[-1]["id"] == "s2-69"
    broken = rows[72]
    assert broken["id"] == "line-3" and broken["error_stage"] == "read"
    assert sum(r["status"] == "ok" for r in rows) == 210

    code, output = run_cli("run", str(shards / "*.jsonl"), "-o", str(tmp_path / "glob.parquet"), *QUICK)
    assert [r["id"] for r in read(tmp_path / "glob.parquet")] == [r["id"] for r in rows]
    code, output = run_cli("validate", str(shards))
    assert code == 1 and f"{'00001.jsonl'}:3: row: invalid JSON" in output

    # Reading from any mark the scan noted gives the rest of the job, across shard boundaries.
    index = scan(shards)
    everything = list(iter_rows(index.source))
    assert len(index.marks) == 6 and {m.shard for m in index.marks} == {0, 1, 2}
    for mark in index.marks:
        assert _key(iter_rows(index.source, start=mark)) == _key(everything[mark.index :])


def test_ids_must_be_unique_across_shards_and_formats_must_not_mix(tmp_path, scripted):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", [{"id": "x", "prompt": "p"}])
    write_jsonl(shards / "b.jsonl", [{"id": "y", "prompt": "p"}, {"id": "x", "prompt": "q"}])
    code, output = run_cli("run", str(shards), "-o", str(tmp_path / "out.parquet"), *QUICK)
    assert code == 2 and "duplicate id 'x' at a.jsonl line 1 and b.jsonl line 2" in output
    (shards / "c.csv").write_text("id,prompt\nz,p\n")
    code, output = run_cli("run", str(shards), "-o", str(tmp_path / "out.parquet"), *QUICK)
    assert code == 2 and "shards of several formats (1 csv, 2 jsonl); pass --format" in output
    code, output = run_cli("run", str(shards), "-o", str(tmp_path / "out.parquet"), "--format", "csv", *QUICK)
    assert code == 0 and [r["id"] for r in read(tmp_path / "out.parquet")] == ["z"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, output = run_cli("run", str(empty), "-o", str(tmp_path / "e.parquet"), *QUICK)
    assert code == 2 and "no job files in it" in output


def _tar(path, samples):
    """A WebDataset shard as img2dataset writes it: KEY.jpg, KEY.txt, KEY.json per sample."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_give_a_row_per_sample(tmp_path):
    rng = random.Random(5)
    folder = tmp_path / "wds"
    folder.mkdir()
    answers = {}
    for shard in range(2):
        samples = []
        for i in range(8):
            key = f"{shard:05d}{i:04d}"
            shape = ("circle", "square", "triangle", "star")[(i + shard) % 4]
            buf = io.BytesIO()
            shapes.draw(shape, rng.choice(["red", "blue", "green"]), rng).save(buf, format="JPEG", quality=95)
            meta = {"key": key, "url": f"https://example.com/{key}.jpg", "width": 56, "status": "success"}
            # The tiny captioner knows three questions only: the caption holds one of them.
            members = {
                "jpg": buf.getvalue(),
                "txt": b"What shape is this?",
                "json": json.dumps(meta).encode(),
            }
            samples.append((key, members))
            answers[key] = shape
        _tar(folder / f"{shard:05d}.tar", samples)
        # img2dataset writes each shard's metadata beside it: the tars are the job.
        (folder / f"{shard:05d}.parquet").write_bytes(b"PAR1 not read")
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(folder), "-o", str(out), "--model", CAPTIONER, "--temperature", "0",
                           "--max-tokens", "6", "--prompt-template", "{caption}")  # fmt: skip
    assert code == 0, output
    rows = read(out)
    assert [r["id"] for r in rows] == list(answers)
    assert sum(r["generated_text"].strip() == answers[r["id"]] for r in rows) >= 15
    assert rows[0]["url"] == "https://example.com/000000000.jpg" and rows[0]["width"] == 56
    assert "image" not in rows[0] and "not copied to the output: image" in output

    index = scan(folder)
    assert index.format == "webdataset" and len(index.ids) == 16
    everything = list(iter_rows(index.source))
    for mark in index.marks[1:]:
        assert _key(iter_rows(index.source, start=mark)) == _key(everything[mark.index :])


def test_a_broken_tar_is_an_unreadable_job(tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    _tar(folder / "00000.tar", [("a", {"txt": b"hello"})])
    (folder / "00001.tar").write_bytes(b"\x00garbage" * 100)
    code, output = run_cli("run", str(folder), "-o", str(tmp_path / "out.parquet"), *QUICK)
    assert code == 2 and "00001.tar: not a readable WebDataset tar file" in output


@pytest.mark.parametrize("bad", ["no such file", "*.nothing"])
def test_a_job_that_is_not_there(tmp_path, bad):
    code, output = run_cli("run", str(tmp_path / bad), "-o", str(tmp_path / "out.parquet"), *QUICK)
    assert code == 2 and ("no such job file" in output or "matches no file" in output)

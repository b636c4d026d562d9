"""Hostile input, round four: exports that stay inside the dataset and never write over a
picture, the results or the job; captions that follow the picture (a replaced picture is a
changed row); no empty success; strict JSON; and the smaller round-four cases."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import stat
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import MODELS, ROOT, batch, read, run_cli, write_jsonl
from PIL import Image

from batchgen.output.store import atomic_write

sys.path.insert(0, str(ROOT / "scripts"))

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = str(MODELS / "shapes-vlm")
QUIET = ("--temperature", "0", "--max-tokens", "6", "-q")
DATASET = ("--image-column", "jpg", "--id-column", "key", "--prompt-template", "Hi.")  # an img2dataset shard


def _picture(path, seed: int) -> bytes:
    """A small PNG whose pixels differ with the seed, written at `path`; its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    Image.new("RGB", (24, 24), tuple(rng.randrange(256) for _ in range(3))).save(path)
    return path.read_bytes()


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 24), tuple(random.Random(seed).randrange(256) for _ in range(3))).save(buf, "PNG")
    return buf.getvalue()


def _caption(folder, out, *extra):
    """`batchgen caption` of a folder (the scripted engine answers each row with its id)."""
    return run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "-p", "Describe.", *QUIET,
                   *extra)  # fmt: skip


def _tree(root) -> dict[str, bytes | str]:
    """Every path under root: a file's bytes, a link's target, a FIFO or folder by its kind."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        key = str(path.relative_to(root))
        if stat.S_ISLNK(info.st_mode):
            out[key] = "link:" + os.readlink(path)
        elif stat.S_ISREG(info.st_mode):
            out[key] = path.read_bytes()
        else:
            out[key] = "fifo" if stat.S_ISFIFO(info.st_mode) else "dir"
    return out


# -- 1. only what the run read as media ---------------------------------------------------------


def test_a_carried_data_column_naming_a_file_is_never_exported(tmp_path, scripted, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _picture(tmp_path / "pics" / "a.png", 1)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "secret.key").write_text("SECRET")
    row = {"id": "r1", "jpg": "pics/a.png", "image": "victim/secret.key", "prompt": "What is it?"}
    job = write_jsonl(tmp_path / "job.jsonl", [row])
    assert batch(job, tmp_path / "r.parquet", "--image-column", "jpg")[0] == 0
    results = str(tmp_path / "r.parquet")
    assert read(tmp_path / "r.parquet")[0]["media_files"][0]["ref"] == "pics/a.png"  # what it read
    assert run_cli("export", results, "--format", "txt")[0] == 0
    assert run_cli("export", results, "--format", "imagefolder")[0] == 0
    code, output = run_cli("export", results, "--format", "imagefolder", "--to", "leak")
    assert code == 0, output
    assert sorted(os.listdir("victim")) == ["secret.key"]  # no secret.txt, no metadata.jsonl
    assert (tmp_path / "pics" / "a.txt").read_text() == "scripted answer to r1\n"
    assert sorted(p.name for p in (tmp_path / "leak").iterdir()) == [".batchgen-export.json", "a.png",
                                                                     "metadata.jsonl"]  # fmt: skip
    assert json.loads((tmp_path / "leak" / "metadata.jsonl").read_text())["file_name"] == "a.png"


def test_a_remote_jobs_output_opens_no_local_file_on_export(tmp_path, scripted, monkeypatch):
    """An output whose media policy says no local paths (a remote job): export opens none,
    even where a row's reference names one that exists here."""
    monkeypatch.chdir(tmp_path)
    _picture(tmp_path / "a.png", 1)
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "r1", "image": "a.png", "prompt": "?"}])
    out = tmp_path / "r.parquet"
    assert batch(job, out)[0] == 0
    table = pq.read_table(out)
    meta = {**table.schema.metadata, b"batchgen.media_policy": b'{"local_paths": false}'}
    pq.write_table(table.replace_schema_metadata(meta), out)
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 1 and "wrote 0 (1 media not found)" in output, output
    assert not (tmp_path / "a.txt").exists()


# -- 2. never over a picture, the results or the job ------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("--format", "txt", "--caption-extension", ".png", "--on-existing", "overwrite"), "a media or results"),
    (("--format", "txt", "--caption-extension", ".JPG"), "a media or results extension"),
    (("--format", "txt", "--caption-extension", ".parquet"), "a media or results extension"),
    (("--format", "txt", "--caption-extension", "txt"), "give a file extension such as .txt"),
    (("--format", "txt", "--caption-extension", "../x"), "give a file extension such as .txt"),
    (("--format", "txt", "--caption-extension", ".a/b"), "give a file extension such as .txt"),
    (("--format", "jsonl", "-o", "{results}"), "is part of the results"),
    (("--format", "wide", "-o", "{results}.stats.json"), "is part of the results"),
    (("--format", "jsonl", "-o", "ds/a.png"), "is a media file of these results"),
    (("--format", "jsonl", "-o", "{job}"), "is part of the job"),
    (("--format", "jsonl", "-o", "ds"), "is a folder"),
])  # fmt: skip
def test_a_target_that_is_a_picture_the_results_or_the_job_is_refused(tmp_path, scripted, monkeypatch, args,
                                                                      message):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    pictures = {name: _picture(tmp_path / "ds" / name, i) for i, name in enumerate(["a.png", "a.jpg.png"])}
    out = tmp_path / "caps.parquet"
    assert _caption(tmp_path / "ds", out)[0] == 0
    before = {"out": out.read_bytes(), "job": (tmp_path / "caps.parquet.jobs.jsonl").read_bytes()}
    given = [a.format(results=out, job=tmp_path / "caps.parquet.jobs.jsonl") for a in args]
    code, output = run_cli("export", str(out), *given)
    assert code == 2 and message in output, output
    assert output.count("\n") == 1 and "Traceback" not in output
    assert {n: (tmp_path / "ds" / n).read_bytes() for n in pictures} == pictures
    assert before == {"out": out.read_bytes(), "job": (tmp_path / "caps.parquet.jobs.jsonl").read_bytes()}
    assert sorted(os.listdir(tmp_path / "ds")) == sorted(pictures)  # nothing written


# -- 3. a picture replaced under its name ------------------------------------------------------


def test_a_picture_replaced_in_place_is_a_changed_row(tmp_path):
    folder = tmp_path / "dataset"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(1)).save(folder / "red_circle.png")
    shapes.draw("square", "blue", random.Random(1)).save(folder / "blue_square.png")
    out = tmp_path / "caps.parquet"
    run = ("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "-p", "What shape is this?", *QUIET)
    assert run_cli(*run)[0] == 0
    assert {r["file"]: r["generated_text"] for r in read(out)}["dataset/blue_square.png"] == "square"
    os.utime(folder / "red_circle.png")  # touched (or copied): same content, kept
    code, output = run_cli(*run)
    assert code == 0 and "nothing to do" in output, output
    shapes.draw("star", "yellow", random.Random(2)).save(folder / "blue_square.png")  # re-cropped in place
    code, output = run_cli(*run)
    assert code == 2, output
    assert "1 row(s) changed since their results were written" in output
    assert "dataset/blue_square.png replaced" in output and "--changed redo" in output
    code, output = run_cli(*run, "--changed", "keep")
    captions = {r["file"]: r["generated_text"] for r in read(out)}
    assert code == 0 and captions["dataset/blue_square.png"] == "square"
    code, output = run_cli(*run, "--changed", "redo")
    assert code == 0 and "(1 resumed)" in output, output
    assert {r["file"]: r["generated_text"] for r in read(out)}["dataset/blue_square.png"] == "star"
    assert run_cli("export", str(out), "--format", "txt")[0] == 0
    assert (folder / "blue_square.txt").read_text() == "star\n"  # the caption follows the picture
    (folder / "red_circle.png").unlink()
    job = tmp_path / "jobs.jsonl"  # `run` too: a job naming the picture that is gone
    write_jsonl(job, [{"id": "r", "image": "dataset/blue_square.png", "prompt": "What shape is this?"}])
    runs = ("run", str(job), "-o", str(tmp_path / "run.parquet"), "--model", CAPTIONER, *QUIET)
    assert run_cli(*runs)[0] == 0
    (folder / "blue_square.png").write_bytes((folder / "blue_square.png").read_bytes() + b"\0")
    code, output = run_cli(*runs)
    assert code == 2 and "line 1 (id 'r'; dataset/blue_square.png replaced)" in output, output


# -- 4. exports that write nothing fail ---------------------------------------------------------


def _dataset_shard(path, n: int = 3, first: int = 0) -> list[bytes]:
    """An img2dataset-style shard: `key` and the pictures' bytes in `jpg`."""
    pictures = [_png(first + i) for i in range(n)]
    pq.write_table(pa.table({"key": [f"{i:09d}" for i in range(n)], "jpg": pictures}), path)
    return pictures


def test_pictures_held_as_bytes_are_written_out_by_imagefolder_and_txt_says_why_not(tmp_path, scripted):
    import datasets

    shard = tmp_path / "00000.parquet"
    pictures = _dataset_shard(shard)
    out = tmp_path / "caps.parquet"
    code, output = batch(shard, out, *DATASET)
    assert code == 0, output
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 1 and "wrote 0 (3 held as bytes, no file)" in output
    assert "no caption file can go beside them (--format imagefolder --to DIR" in output
    code, output = run_cli("export", str(out), "--format", "imagefolder")
    assert code == 2 and "give --to DIR to write them out" in output
    hf = tmp_path / "hf"
    code, output = run_cli("export", str(out), "--format", "imagefolder", "--to", str(hf))
    assert code == 0 and "wrote 3 (nothing left out)" in output and "3 pictures" in output, output
    loaded = datasets.load_dataset("imagefolder", data_dir=str(hf), split="train")
    by_text = {r["text"]: r["image"] for r in loaded}
    for i, data in enumerate(pictures):  # each picture beside its own row's answer
        shown = by_text[f"scripted answer to {i:09d}"]
        assert shown.tobytes() == Image.open(io.BytesIO(data)).tobytes()
    # the job replaced since the run: its new pictures are not the ones the answers are about
    _dataset_shard(shard, 3, first=10)
    code, output = run_cli("export", str(out), "--format", "imagefolder", "--to", str(tmp_path / "hf2"))
    assert code == 1 and "wrote 0 (3 media not found)" in output, output


def test_an_export_of_only_failed_rows_exits_1(tmp_path, scripted):
    _picture(tmp_path / "ds" / "a.png", 1)
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "a", "image": "ds/a.png", "prompt": "?",
                                               "script": "fail"}])  # fmt: skip
    out = tmp_path / "r.parquet"
    assert batch(job, out)[0] == 1
    for fmt in ("txt", "imagefolder"):
        code, output = run_cli("export", str(out), "--format", fmt)
        assert code == 1 and "wrote 0 (1 failed)" in output, output
    assert not (tmp_path / "ds" / "a.txt").exists()


# -- 5, 6. copies by default; metadata.jsonl only where it belongs -----------------------------


def test_imagefolder_copies_by_default_and_links_only_when_asked(tmp_path, scripted):
    original = _picture(tmp_path / "ds" / "a.png", 1)
    out = tmp_path / "caps.parquet"
    assert _caption(tmp_path / "ds", out)[0] == 0
    copy = tmp_path / "hf"
    assert run_cli("export", str(out), "--format", "imagefolder", "--to", str(copy))[0] == 0
    assert (copy / "a.png").stat().st_ino != (tmp_path / "ds" / "a.png").stat().st_ino
    (copy / "a.png").write_bytes(b"edited by the trainer")
    assert (tmp_path / "ds" / "a.png").read_bytes() == original  # the source picture untouched
    assert run_cli("export", str(out), "--format", "imagefolder", "--to", str(copy))[0] == 0
    assert (copy / "a.png").read_bytes() == original  # a copy that differs is replaced by a fresh one
    hard, soft = tmp_path / "hard", tmp_path / "soft"
    assert run_cli("export", str(out), "--format", "imagefolder", "--to", str(hard), "--link", "hard")[0] == 0
    assert (hard / "a.png").stat().st_ino == (tmp_path / "ds" / "a.png").stat().st_ino
    assert run_cli("export", str(out), "--format", "imagefolder", "--to", str(soft), "--link",
                   "symbolic")[0] == 0  # fmt: skip
    assert os.readlink(soft / "a.png") == str((tmp_path / "ds" / "a.png").resolve())
    assert "--link" in run_cli("export", "--help")[1] and "copies" in run_cli("export", "--help")[1]


def test_metadata_goes_only_where_the_pictures_share_a_folder_and_is_never_someone_elses(tmp_path, scripted):
    a, b = tmp_path / "one" / "a.png", tmp_path / "two" / "b.png"
    _picture(a, 1), _picture(b, 2)
    (tmp_path / "jobs").mkdir()
    rows = [{"id": "a", "image": str(a), "prompt": "?"}, {"id": "b", "image": str(b), "prompt": "?"}]
    job = write_jsonl(tmp_path / "jobs" / "job.jsonl", rows)
    out = tmp_path / "jobs" / "r.parquet"
    assert batch(job, out)[0] == 0
    code, output = run_cli("export", str(out), "--format", "imagefolder")
    assert code == 2 and "the pictures share no folder of their own" in output and "give --to DIR" in output
    assert not (tmp_path / "metadata.jsonl").exists()
    photos = tmp_path / "photos"  # captioned from another folder: their own folder takes it
    _picture(photos / "p.png", 4)
    assert _caption(photos, tmp_path / "runs" / "p.parquet")[0] == 0
    assert run_cli("export", str(tmp_path / "runs" / "p.parquet"), "--format", "imagefolder")[0] == 0
    assert json.loads((photos / "metadata.jsonl").read_text())["file_name"] == "p.png"
    folder = tmp_path / "ds"
    _picture(folder / "c.png", 3)
    (folder / "metadata.jsonl").write_text('{"file_name": "c.png", "text": "hand-written"}\n')
    caps = tmp_path / "caps.parquet"
    assert _caption(folder, caps)[0] == 0
    code, output = run_cli("export", str(caps), "--format", "imagefolder")
    assert code == 2 and "not written by batchgen" in output, output
    assert "hand-written" in (folder / "metadata.jsonl").read_text()
    (folder / "metadata.jsonl").unlink()
    assert run_cli("export", str(caps), "--format", "imagefolder")[0] == 0
    assert run_cli("export", str(caps), "--format", "imagefolder")[0] == 0  # its own: replaced
    (folder / "metadata.jsonl").write_text((folder / "metadata.jsonl").read_text() + "\n")  # edited since
    assert run_cli("export", str(caps), "--format", "imagefolder")[0] == 2


# -- 7, 8. one caption per picture, captions that are text -------------------------------------


def test_two_pictures_with_one_stem_are_named_and_refused(tmp_path, scripted):
    _picture(tmp_path / "ds" / "a.png", 1), _picture(tmp_path / "ds" / "a.jpg", 2)
    out = tmp_path / "caps.parquet"
    assert _caption(tmp_path / "ds", out)[0] == 0
    for mode in ("skip", "append"):
        code, output = run_cli("export", str(out), "--format", "txt", "--on-existing", mode)
        assert code == 2 and "1 picture(s) would share a caption file" in output and "→ a.txt" in output
        assert "--caption-name with-extension" in output and not (tmp_path / "ds" / "a.txt").exists()
    code, output = run_cli("export", str(out), "--format", "txt", "--caption-name", "with-extension")
    assert code == 0 and "wrote 2" in output
    assert (tmp_path / "ds" / "a.png.txt").read_text() == "scripted answer to ds/a.png#0\n"
    assert (tmp_path / "ds" / "a.jpg.txt").read_text() == "scripted answer to ds/a.jpg#0\n"


def test_structured_answers_need_a_field_and_empty_captions_are_not_written(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(1)).save(folder / "a.png")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["shape", "tags"], "properties": {
        "shape": {"enum": ["circle", "square"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 0}}}))  # fmt: skip
    out = tmp_path / "caps.parquet"
    run = ("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "-p", "Describe it.",
           "--json-schema", str(schema), "--temperature", "0", "--max-tokens", "32", "-q")  # fmt: skip
    code, output = run_cli(*run, "--write-captions", "txt")
    assert code == 2 and "choose the caption with --field F (the results have shape, tags)" in output, output
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 2 and "the answers are JSON" in output
    assert run_cli("export", str(out), "--format", "imagefolder")[0] == 2
    assert not (folder / "a.txt").exists() and not (folder / "metadata.jsonl").exists()
    code, output = run_cli("export", str(out), "--format", "txt", "--field", "tags")
    assert code == 1 and "wrote 0 (1 empty, not written)" in output, output
    assert not (folder / "a.txt").exists()
    code, output = run_cli("export", str(out), "--format", "txt", "--field", "shape")
    assert code == 0 and (folder / "a.txt").read_text() == "circle\n"


# -- 11, 12. odd names and files --------------------------------------------------------------


def test_a_255_byte_picture_name_is_captioned_and_a_name_too_long_stops_nothing(tmp_path, scripted):
    long = "x" * 251 + ".png"  # the longest name the filesystem takes
    _picture(tmp_path / "ds" / long, 1), _picture(tmp_path / "ds" / "b.png", 2)
    out = tmp_path / "caps.parquet"
    assert _caption(tmp_path / "ds", out)[0] == 0
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 0 and "wrote 2" in output, output
    assert (tmp_path / "ds" / ("x" * 251 + ".txt")).read_text() == f"scripted answer to ds/{long}#0\n"
    code, output = run_cli("export", str(out), "--format", "txt", "--caption-name", "with-extension")
    assert code == 1 and "wrote 1 (1 could not be written)" in output and "File name too long" in output
    assert (tmp_path / "ds" / "b.png.txt").exists() and "Traceback" not in output


def test_caption_targets_that_are_folders_fifos_or_links_are_never_written_through(tmp_path, scripted):
    folder = tmp_path / "ds"
    for i, name in enumerate(("a.png", "b.png", "c.png", "d.png")):
        _picture(folder / name, i)
    out = tmp_path / "caps.parquet"
    assert _caption(folder, out)[0] == 0
    (folder / "a.txt").mkdir()
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 2 and "a.txt: is a folder" in output and output.count("\n") == 1
    (folder / "a.txt").rmdir()
    os.mkfifo(folder / "b.txt")
    victim = tmp_path / "victim.txt"
    victim.write_text("private")
    (folder / "c.txt").symlink_to(victim)
    signal.alarm(30)  # a FIFO that is read blocks: this fails rather than hangs
    try:
        code, output = run_cli("export", str(out), "--format", "txt", "--on-existing", "append")
    finally:
        signal.alarm(0)
    assert code == 1 and "wrote 2 (2 left alone)" in output, output
    assert "b.txt (not a regular file)" in output and "c.txt (a symbolic link)" in output
    assert stat.S_ISFIFO((folder / "b.txt").lstat().st_mode) and os.readlink(folder / "c.txt") == str(victim)
    assert victim.read_text() == "private" and "private" not in (folder / "a.txt").read_text()


def test_a_killed_exports_temporary_file_is_cleared_and_a_failed_write_leaves_none(tmp_path, scripted):
    _picture(tmp_path / "ds" / "a.png", 1)
    out = tmp_path / "caps.parquet"
    assert _caption(tmp_path / "ds", out)[0] == 0
    left = tmp_path / "ds" / ".batchgen-0123456789ab.tmp"  # what a kill -9 mid-write leaves
    left.write_bytes(b"")
    os.utime(left, (time.time() - 3600,) * 2)
    assert run_cli("export", str(out), "--format", "txt")[0] == 0
    kept = [".batchgen-captions.json", "a.png", "a.txt"]  # the caption, and the record that it is ours
    assert sorted(os.listdir(tmp_path / "ds")) == kept

    def broken(path):
        path.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(tmp_path / "ds" / "a.txt", broken)
    assert sorted(os.listdir(tmp_path / "ds")) == kept
    assert (tmp_path / "ds" / "a.txt").read_text() == "scripted answer to ds/a.png#0\n"


# -- fuzz: random names, extensions, collisions, links and FIFOs --------------------------------


def _hostile_folder(root, r: random.Random) -> None:
    """Pictures with odd names, and odd things where their caption files would go."""
    names = [
        "a.png",
        "A.PNG",
        "a b.png",
        "ünï cødé.png",
        "x" * 240 + ".png",
        ".hidden.png",
        "-dash.png",
        "dots.in.name.png",
        "sub/a.png",
        "sub/deep/b.jpg",
        "sub/deep/b.png",
        "c.png.png",
        "d.gif",
    ]
    for i, name in enumerate(r.sample(names, 7)):
        _picture(root / name, i)
        target = (root / name).with_suffix(".txt")
        kind = r.randrange(6)
        if kind == 0 and not target.exists():
            os.mkfifo(target)
        elif kind == 1 and not target.exists():
            target.symlink_to(root.parent / "victim.txt")
        elif kind == 2 and not target.exists():
            target.write_text("old caption\n")
    if r.random() < 0.3:
        (root / "metadata.jsonl").write_text("someone else's\n")


def test_fuzzed_exports_write_nothing_outside_their_folder_and_over_no_picture(tmp_path, scripted):
    r = random.Random(4)
    codes: list[int] = []
    for trial in range(30):
        base = tmp_path / f"t{trial}"
        root = base / "ds"
        root.mkdir(parents=True)
        (base / "victim.txt").write_text("private")
        _hostile_folder(root, r)
        out = base / "caps.parquet"
        assert _caption(root, out)[0] == 0
        before = _tree(base)
        pictures = {k: v for k, v in before.items() if k.lower().endswith((".png", ".jpg", ".gif"))}
        fmt = r.choice(["txt", "imagefolder"])
        args = ["--format", fmt, "--on-existing", r.choice(["skip", "overwrite", "append", "prepend"])]
        if fmt == "txt":
            extensions = [".txt", ".txt", ".caption", ".json", ".png", ".PNG", "../x"]
            args += ["--caption-extension", r.choice(extensions)]
        if r.random() < 0.4:
            args += (
                ["--caption-name", "with-extension"]
                if fmt == "txt"
                else ["--link", r.choice(["hard", "symbolic"])]
            )
        to = r.choice([None, None, base / "export", root / "sub", root])
        if to is not None:
            args += ["--to", str(to)]
        signal.alarm(60)
        try:
            code, output = run_cli("export", str(out), *args)
        finally:
            signal.alarm(0)
        assert code in (0, 1, 2) and "Traceback" not in output, (args, output)
        codes.append(code)
        after = _tree(base)
        assert after["victim.txt"] == b"private", args
        for name, data in pictures.items():
            assert after.get(name) == data, (args, name, output)  # no picture written over or moved
        for name, now in after.items():
            if before.get(name) != now:
                path = (base / name).parent.resolve() / (base / name).name  # a link itself, not its target
                in_to = to is not None and path.is_relative_to(to.resolve())
                assert in_to or path.is_relative_to(root.resolve()), (args, name)  # nowhere else
                if not in_to:
                    assert path.suffix in (".txt", ".caption", ".json", ".jsonl") or name.endswith(
                        (".txt", ".caption", "metadata.jsonl", ".batchgen-export.json")
                    ), (args, name)  # beside the pictures: captions and metadata only
        assert not [n for n in after if ".batchgen-" in n and n.endswith(".tmp")], args
    assert codes.count(0) + codes.count(1) >= 8 and codes.count(2) >= 5, codes  # both writes and refusals


# -- 9, 14. answer columns: one type across shards, a cap per schema ---------------------------


def test_a_shard_folder_types_an_answer_field_one_way_across_its_shards(tmp_path, scripted):
    import pandas as pd

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    as_int = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    as_text = {"type": "object", "properties": {"x": {"type": "string"}}}
    write_jsonl(jobs / "a.jsonl", [{"id": "a", "prompt": "?", "json_schema": as_int}])
    write_jsonl(jobs / "b.jsonl", [{"id": "b", "prompt": "?", "json_schema": as_text}])
    out = tmp_path / "out"
    assert batch(jobs, out, "-o", f"{out}/")[0] in (0, 1)
    types = {p.name: pq.read_schema(p).field("answer.x").type for p in out.glob("*.parquet")}
    assert types == {"a.parquet": pa.string(), "b.parquet": pa.string()}  # the union: JSON text
    assert {p.name: pq.read_schema(p).names.count("answer.y") for p in out.glob("*.parquet")} == {
        "a.parquet": 1, "b.parquet": 1}  # fmt: skip
    assert len(pd.read_parquet(out)) == 2 and pq.read_table(out).num_rows == 2
    assert run_cli("inspect", str(out))[0] == 0


def test_the_answer_column_cap_is_per_schema(tmp_path, scripted):
    wide = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(64)}}
    small = {"type": "object", "properties": {"caption": {"type": "string"}, "n": {"type": "integer"},
                                               "ok": {"type": "boolean"}}}  # fmt: skip
    too_wide = {"type": "object", "properties": {f"g{i}": {"type": "string"} for i in range(65)}}
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": i, "prompt": "?", "json_schema": s}
                                               for i, s in enumerate((wide, small, too_wide))])  # fmt: skip
    out = tmp_path / "out.parquet"
    batch(job, out)
    names = [n for n in pq.read_schema(out).names if n.startswith("answer.")]
    assert len(names) == 67 and {"answer.caption", "answer.n", "answer.ok", "answer.f63"} <= set(names)
    assert pq.read_schema(out).field("answer.n").type == pa.int64()


# -- 10. strict JSON ---------------------------------------------------------------------------


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_masked_alternatives_are_left_out_of_top_logprobs_and_every_json_file_is_strict(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                  "required": ["a"]}))  # fmt: skip
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "q", "prompt": "Say something."}])
    out = tmp_path / "out.parquet"
    lm = str(MODELS / "tiny-lm")
    code, output = run_cli("run", str(job), "-o", str(out), "--text-model", lm, "--model", lm,
                           "--json-schema", str(schema), "--top-logprobs", "5", "--temperature", "0",
                           "--max-tokens", "16", "--output-format", "both", "-q")  # fmt: skip
    assert code == 0, output
    line = _strict((tmp_path / "out.openai.jsonl").read_text())
    tokens = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert tokens and all(len(t["top_logprobs"]) <= 5 for t in tokens)
    assert any(len(t["top_logprobs"]) < 5 for t in tokens)  # `{` alone was allowed first
    assert all(t["logprob"] > float("-inf") for tok in tokens for t in tok["top_logprobs"])
    _strict((tmp_path / "out.parquet.stats.json").read_text())
    rows = read(out)
    assert all(t["logprob"] > float("-inf") for tok in rows[0]["logprobs"] for t in tok["top_logprobs"])
    assert run_cli("export", str(out), "--format", "jsonl", "-o", str(tmp_path / "e.jsonl"))[0] == 0
    for text in (tmp_path / "e.jsonl").read_text().splitlines():
        _strict(text)


# -- 13, 15, 16. the smaller cases -------------------------------------------------------------


def test_inspect_reads_a_damaged_or_fifo_stats_file_as_none(tmp_path, scripted):
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "a", "prompt": "Hi."}])
    out = tmp_path / "out.parquet"
    assert batch(job, out)[0] == 0
    stats = tmp_path / "out.parquet.stats.json"
    for damage in ('{"tokens_per_s": "fast", "complete": false, "job_rows": "x"}', "{not json", "[1, 2]",
                   "\x00" * 10, " " * (2 << 20)):  # fmt: skip
        stats.write_text(damage)
        code, output = run_cli("inspect", str(out))
        assert code == 0 and "1 row, 1 ok, 0 failed" in output, (damage[:20], output)
    stats.unlink()
    os.mkfifo(stats)
    signal.alarm(30)
    try:
        code, output = run_cli("inspect", str(out))
    finally:
        signal.alarm(0)
    assert code == 0 and "1 row, 1 ok" in output


def test_a_mirrored_shard_whose_job_file_is_gone_says_so(tmp_path, scripted):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    write_jsonl(jobs / "a.jsonl", [{"id": "a", "prompt": "Hi."}])
    write_jsonl(jobs / "b.jsonl", [{"id": "b", "prompt": "Hi."}])
    out = tmp_path / "out"
    assert batch(jobs, out, "-o", f"{out}/")[0] == 0
    (jobs / "b.jsonl").rename(jobs / "c.jsonl")
    code, output = batch(jobs, out, "-o", f"{out}/")
    assert code == 2, output
    assert "b.parquet holds batchgen's results for a job file no longer in the job (b.* removed or " in output
    assert "not a shard batchgen wrote" not in output
    (tmp_path / "spark.parquet").write_bytes(b"")
    pq.write_table(pa.table({"x": [1]}), out / "part-00000-uuid.snappy.parquet")
    (jobs / "c.jsonl").rename(jobs / "b.jsonl")
    code, output = batch(jobs, out, "-o", f"{out}/")
    assert code == 2 and "part-00000-uuid.snappy.parquet is not a shard batchgen wrote" in output


def test_repeated_choices_are_refused_and_the_scored_bound_is_named(tmp_path, scripted):
    rows = [{"id": "dup", "prompt": "?", "choices_to_score": ["yes", "no", "yes"]},
            {"id": "guided", "prompt": "?", "guided_choice": ["a", "b", "a"]},
            {"id": "many", "prompt": "?", "guided_choice": [f"c{i}" for i in range(70)], "score_only": True},
            {"id": "fine", "prompt": "?", "choices_to_score": ["yes", "no"], "score_only": True}]  # fmt: skip
    job = write_jsonl(tmp_path / "job.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = batch(job, out)
    got = {r["id"]: r for r in read(out)}
    assert got["dup"]["error_stage"] == "read" and "'yes' given twice" in got["dup"]["error"]
    assert "guided_choice: 'a' given twice" in got["guided"]["error"]
    assert "a guided_choice of 70 choices is over the 64 that can be scored" in got["many"]["error"]
    assert "nothing to score" not in got["many"]["error"]
    twice = ("--choices-to-score", "yes", "--choices-to-score", "yes")
    code, output = batch(job, tmp_path / "o2.parquet", *twice)
    assert code == 2 and "given twice" in output


def test_the_gallery_shows_no_picture_from_a_job_replaced_since_the_run(tmp_path, scripted):
    from test_hostile_three import _gallery_data

    shard = tmp_path / "00000.parquet"
    _dataset_shard(shard, 2)
    out = tmp_path / "caps.parquet"
    assert batch(shard, out, *DATASET)[0] == 0
    page = tmp_path / "g.html"
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    assert all(c["media"] for c in _gallery_data(page)["cards"])
    table = pq.read_table(shard)
    pq.write_table(table.set_column(1, "jpg", pa.array([_png(7), table.column("jpg")[1].as_py()])), shard)
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    shown = {c["id"]: c["media"] for c in _gallery_data(page)["cards"]}
    assert shown["000000000"] == [] and shown["000000001"] != []  # the replaced row shows none


def test_media_digests_recorded_match_the_pictures(tmp_path, scripted):
    data = _picture(tmp_path / "ds" / "a.png", 1)
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "a", "image": "ds/a.png", "prompt": "?"},
                                               {"id": "t", "prompt": "text only"}])  # fmt: skip
    out = tmp_path / "out.parquet"
    assert batch(job, out)[0] == 0
    rows = {r["id"]: r for r in read(out)}
    (media,) = rows["a"]["media_files"]
    info = (tmp_path / "ds" / "a.png").stat()
    assert media == {"kind": "image", "ref": "ds/a.png", "size": len(data), "mtime_ns": info.st_mtime_ns,
                     "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    assert rows["t"]["media_files"] is None

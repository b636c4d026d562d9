"""`batchgen export` on a real captioning run (the bundled shapes captioner): caption files
beside the images or mirrored, trigger words, every `--on-existing` mode, an imagefolder that
`datasets` loads with the right caption per image, and one row per image."""

from __future__ import annotations

import json
import random
import sys

import pyarrow.parquet as pq
import pytest
from conftest import MODELS, ROOT, run_cli

sys.path.insert(0, str(ROOT / "scripts"))

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = str(MODELS / "shapes-vlm")
PROMPTS = ("--prompt", "What shape is this?", "--prompt", "What colour is the shape?")
QUIET = ("--temperature", "0", "--max-tokens", "6", "-q")
PICTURES = {"red_circle.png": ("circle", "red"), "sub/blue_square.png": ("square", "blue"),
            "sub/deeper/yellow_star.png": ("star", "yellow")}  # fmt: skip


def _draw(folder, seed):
    """The PICTURES, drawn by the captioner's own training script, in a nested folder."""
    rng = random.Random(seed)
    for name, (shape, colour) in PICTURES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shapes.draw(shape, colour, rng).save(folder / name)


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    """A nested folder captioned with two prompts, and a broken file among the images."""
    root = tmp_path_factory.mktemp("export")
    folder = root / "ds"
    _draw(folder, seed=3)
    (folder / "broken.png").write_bytes(b"not a png")
    out = root / "captions.parquet"
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *PROMPTS, *QUIET)
    assert code == 1, output  # the broken file's two rows failed
    return folder, out


def _fresh(captioned, tmp_path):
    """A copy of the captioned folder (caption files are written beside the images) and its results."""
    import shutil

    folder, out = captioned
    copy = tmp_path / "ds"
    shutil.copytree(folder, copy)
    results = tmp_path / "captions.parquet"
    table = pq.read_table(out)
    meta = {**table.schema.metadata, b"batchgen.media_base": str(tmp_path).encode()}  # where the copy is
    pq.write_table(table.replace_schema_metadata(meta), results)
    return copy, results


def test_caption_files_beside_the_images_with_trigger_words_and_each_existing_mode(captioned, tmp_path):
    folder, results = _fresh(captioned, tmp_path)
    code, output = run_cli("export", str(results), "--format", "txt", "--prompt", "0", "--prefix", "ohwx, ")
    assert code == 0, output
    assert "wrote 3 (1 failed)" in output
    for name, (shape, _) in PICTURES.items():
        assert (folder / name).with_suffix(".txt").read_text() == f"ohwx, {shape}\n"
    assert not (folder / "broken.txt").exists()  # a failed row writes nothing

    both = ("--join", ", ")
    modes = {"skip": "old tags", "overwrite": "circle, red", "append": "old tags circle, red",
             "prepend": "circle, red old tags"}  # fmt: skip
    for mode, expected in modes.items():
        (folder / "red_circle.txt").write_text("old tags\n")  # as a tagger left it
        code, output = run_cli("export", str(results), "--format", "txt", *both, "--on-existing", mode)
        assert code == (1 if mode == "skip" else 0), output  # a file left alone: exit 1
        assert (folder / "red_circle.txt").read_text() == expected + "\n", mode
    code, output = run_cli("export", str(results), "--format", "txt", *both)  # appended to: not only ours
    assert code == 1 and "wrote 0 (3 already there, not batchgen's, kept, 1 failed)" in output, output
    assert run_cli("export", str(results), "--format", "txt", *both, "--on-existing", "overwrite")[0] == 0
    code, output = run_cli("export", str(results), "--format", "txt", "--prompt", "0")  # ours: refreshed
    assert code == 0 and "wrote 3 (1 failed)" in output, output
    assert (folder / "red_circle.txt").read_text() == "circle\n"
    code, output = run_cli("export", str(results), "--format", "txt", "--prompt", "0")
    assert code == 0 and "wrote 0 (3 up to date, 1 failed)" in output, output
    code, output = run_cli("export", str(results), "--format", "txt")
    assert code == 2 and "pick a prompt (--prompt K) or join them" in output  # two prompts, one file


def test_caption_files_mirrored_under_another_folder(captioned, tmp_path):
    folder, results = _fresh(captioned, tmp_path)
    mirror = tmp_path / "labels"
    code, output = run_cli("export", str(results), "--format", "txt", "--prompt", "What colour is the shape?",
                           "--to", str(mirror), "--caption-extension", ".caption")  # fmt: skip
    assert code == 0, output
    assert sorted(p.relative_to(mirror).as_posix() for p in mirror.rglob("*.caption")) == sorted(
        str(name).rsplit(".", 1)[0] + ".caption" for name in PICTURES
    )
    assert (mirror / "sub" / "deeper" / "yellow_star.caption").read_text() == "yellow\n"
    assert not list(folder.rglob("*.caption"))
    code, output = run_cli("export", str(results), "--format", "txt", "--prompt", "nope")
    assert code == 2 and "--prompt 'nope': no such prompt" in output


def test_an_imagefolder_that_datasets_loads_with_each_images_caption(captioned, tmp_path):
    import datasets

    _, results = _fresh(captioned, tmp_path)
    dataset = tmp_path / "dataset"
    code, output = run_cli("export", str(results), "--format", "imagefolder", "--to", str(dataset))
    assert code == 0, output
    assert "wrote 3 (1 failed)" in output
    lines = [json.loads(line) for line in (dataset / "metadata.jsonl").read_text().splitlines()]
    assert {line["file_name"] for line in lines} == set(PICTURES)  # the broken image left out
    loaded = datasets.load_dataset("imagefolder", data_dir=str(dataset), split="train")
    assert len(loaded) == 3 and {"image", "text_0", "text_1"} <= set(loaded.column_names)
    assert sorted((r["text_0"], r["text_1"]) for r in loaded) == sorted(PICTURES.values())
    for row in loaded:  # the pictures come with the dataset, linked or copied into it
        assert row["image"].size == (56, 56)


def test_one_row_per_image_with_a_column_per_prompt(captioned, tmp_path):
    _, results = _fresh(captioned, tmp_path)
    wide = tmp_path / "wide.parquet"
    code, output = run_cli("export", str(results), "--format", "wide", "-o", str(wide))
    assert code == 0, output
    rows = {r["file"]: r for r in pq.read_table(wide).to_pylist()}
    assert set(rows) == {f"ds/{name}" for name in PICTURES} | {"ds/broken.png"}
    for name, (shape, colour) in PICTURES.items():
        assert (rows[f"ds/{name}"]["text_0"], rows[f"ds/{name}"]["text_1"], rows[f"ds/{name}"]["status"]) == (
            shape, colour, "ok",
        )  # fmt: skip
    assert rows["ds/broken.png"]["status"] == "error" and "decode" in rows["ds/broken.png"]["error"]
    lines = tmp_path / "wide.jsonl"
    assert run_cli("export", str(results), "--format", "jsonl", "-o", str(lines))[0] == 0
    assert len(lines.read_text().splitlines()) == 4
    code, output = run_cli("export", str(results), "--format", "wide")
    assert code == 2 and "give -o FILE" in output


def test_a_changed_prompt_reruns_only_its_rows_with_changed_redo(tmp_path):
    folder = tmp_path / "ds"
    _draw(folder, seed=4)
    out = tmp_path / "captions.parquet"
    run = ("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *QUIET)
    assert run_cli(*run, *PROMPTS)[0] == 0
    before = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    changed = ("--prompt", "What shape is this?", "--prompt", "Which colour is the shape?")
    code, output = run_cli(*run, *changed)
    assert code == 2 and "3 row(s) changed since their results were written" in output
    assert "--changed redo to generate them again, --changed keep to keep their results" in output
    code, output = run_cli(*run, *changed, "--changed", "keep")
    assert code == 0 and "(6 resumed)" in output
    assert {r["id"]: r for r in pq.read_table(out).to_pylist()} == before  # kept as they were
    code, output = run_cli(*run, *changed, "--changed", "redo")
    assert code == 0 and "6 rows: 6 ok, 0 failed (3 resumed)" in output, output
    after = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(after) == set(before)
    for key, row in after.items():
        if key.endswith("#0"):
            assert row == before[key]  # the unchanged prompt's rows: byte for byte
        else:
            assert (
                row["prompt"] == "Which colour is the shape?"
                and row["input_hash"] != before[key]["input_hash"]
            )
            assert row["generated_text"].strip() in {"red", "blue", "yellow"}
    code, output = run_cli(*run, *changed)
    assert code == 0 and "(6 resumed)" in output  # nothing changed since


def test_caption_writes_the_caption_files_at_the_end_of_its_run(tmp_path):
    folder = tmp_path / "ds"
    _draw(folder, seed=2)
    out = tmp_path / "captions.parquet"
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *PROMPTS, *QUIET,
                           "--write-captions", "txt")  # fmt: skip
    assert code == 0 and "wrote 3 (nothing left out)" in output, output
    for name, (shape, colour) in PICTURES.items():
        assert (folder / name).with_suffix(".txt").read_text() == f"{shape} {colour}\n"


def test_an_existing_caption_file_feeds_the_prompt_template(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(1)).save(folder / "a.png")
    shapes.draw("square", "blue", random.Random(2)).save(folder / "b.png")
    (folder / "a.txt").write_text("a red thing\n")
    out = tmp_path / "c.parquet"
    template = "Improve this caption: {caption_txt}"
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "--prompt-template",
                           template, *QUIET)  # fmt: skip
    assert code == 0, output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    a, b = rows["ds/a.png#0"], rows["ds/b.png#0"]
    assert (a["caption_txt"], b["caption_txt"]) == ("a red thing", "")  # no caption file: empty
    assert a["prompt_tokens"] > b["prompt_tokens"]  # the caption reached the prompt
    code, output = run_cli("caption", str(folder), "-o", str(tmp_path / "d.parquet"), "--model", CAPTIONER,
                           "-p", "What shape is this?", *QUIET)  # fmt: skip
    assert code == 0 and "caption_txt" not in pq.read_table(tmp_path / "d.parquet").column_names


TAGS = ["circle", "square", "star", "red", "blue", "yellow"]
CAPTION_AND_TAGS = {"type": "object", "properties": {
    "caption": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"enum": TAGS}, "minItems": 1, "maxItems": 2}},
    "required": ["caption", "tags"]}  # fmt: skip


def test_a_caption_and_tags_schema_gives_typed_columns_and_tag_files(tmp_path):
    folder = tmp_path / "ds"
    _draw(folder, seed=5)
    (folder / "broken.png").write_bytes(b"not a png")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(CAPTION_AND_TAGS))
    out = tmp_path / "captions.parquet"
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "-p", "Describe it.",
                           "--json-schema", str(schema), *QUIET[:2], "--max-tokens", "48", "-q")  # fmt: skip
    assert code == 1, output  # the broken file
    table = pq.read_table(out)
    assert table.schema.field("answer.caption").type == "string"
    assert str(table.schema.field("answer.tags").type) == "list<element: string>"
    names = table.column_names
    assert names.index("answer.caption") == names.index("parsed") + 1  # beside parsed
    rows = {r["file"]: r for r in table.to_pylist()}
    for name in PICTURES:
        row = rows[f"ds/{name}"]
        parsed = json.loads(row["parsed"])
        assert (row["answer.caption"], row["answer.tags"]) == (parsed["caption"], parsed["tags"])
        assert 1 <= len(row["answer.tags"]) <= 2 and set(row["answer.tags"]) <= set(TAGS)
    broken = rows["ds/broken.png"]
    assert broken["status"] == "error" and broken["answer.caption"] is None and broken["answer.tags"] is None

    code, output = run_cli("export", str(out), "--format", "txt", "--field", "tags", "--prefix", "ohwx, ")
    assert code == 0 and "wrote 3 (1 failed)" in output, output
    for name in PICTURES:
        tags = rows[f"ds/{name}"]["answer.tags"]
        assert (folder / name).with_suffix(".txt").read_text() == "ohwx, " + ", ".join(tags) + "\n"
    wide = tmp_path / "wide.parquet"
    assert run_cli("export", str(out), "--format", "wide", "-o", str(wide))[0] == 0
    exported = pq.read_table(wide)
    assert str(exported.schema.field("tags").type) == "list<element: string>"
    assert {r["file"]: r["tags"] for r in exported.to_pylist()} == {
        k: r["answer.tags"] for k, r in rows.items()
    }
    code, output = run_cli("export", str(out), "--format", "txt", "--field", "colour")
    assert code == 2 and "no such answer field (the results have caption, tags)" in output


def test_a_mapped_prompt_column_is_the_question_in_export_and_report(tmp_path, scripted):
    """Questions read as the run read them (input/parse, with the recorded mapping): two
    questions per picture in a dataset's own columns make two answer columns, each picture
    shown once with both questions."""
    import shutil

    (tmp_path / "pics").mkdir()
    for name in ("red_circle.png", "blue_square.webp"):
        shutil.copy(ROOT / "sample_data" / "media" / name, tmp_path / "pics" / name)
    rows = [{"key": f"{name}-{k}", "pic": f"pics/{name}", "ask": question}
            for name in ("red_circle.png", "blue_square.webp")
            for k, question in enumerate(("What shape?", "What colour?"))]  # fmt: skip
    job = tmp_path / "jobs.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    mapping = ("--id-column", "key", "--image-column", "pic", "--prompt-column", "ask")
    code, output = run_cli("run", str(job), "-o", str(out), "--model", "scripted", *mapping, "-q")
    assert code == 0, output
    wide = tmp_path / "wide.parquet"
    code, output = run_cli("export", str(out), "--format", "wide", "-o", str(wide))
    assert code == 0, output
    got = {r["file"]: (r["text_0"], r["text_1"]) for r in pq.read_table(wide).to_pylist()}
    assert got == {f"pics/{name}": (f"scripted answer to {name}-0", f"scripted answer to {name}-1")
                   for name in ("red_circle.png", "blue_square.webp")}  # fmt: skip
    page = tmp_path / "page.html"
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    text = page.read_text()
    assert text.count('"question": "What shape?"') == 2 and text.count('"question": "What colour?"') == 2
    assert text.count('"entries"') == 2  # a card per picture, each with its two questions

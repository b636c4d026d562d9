from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.core.records import Generation, Result
from batchgen.input.read import JobIndex, Rows, scan
from batchgen.output.about import About, JobAbout, MediaAbout, Standing
from batchgen.output.parts import partial_dir
from batchgen.output.pending import Pending
from batchgen.output.resume import Resume
from batchgen.output.write import SingleFile, WriteOptions


def _made(row_id: str, text: str) -> Result:
    """A row its model answered with `text`."""
    gen = Generation(text=text, finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    return Result(id=row_id, generation=gen)


ROW = "ab" * 16  # every row's input fingerprint here


def _writer(out, ids, flush_rows=2, overwrite=False, schema=None, settings=None):
    """A writer opened as a run opens it, with the Resume its earlier results give (`.resume`)."""
    index = JobIndex("jsonl", Rows(ids, digests=bytes.fromhex(ROW) * len(ids)), schema)
    settings = settings or {"model": "m"}
    w = SingleFile(
        out, index, settings, WriteOptions(flush_rows=flush_rows, flush_seconds=3600, overwrite=overwrite)
    )
    w.resume = Resume(w.open(), w.store, index, settings, max_attempts=3, every_failure=False)
    return w


def test_parts_reach_disk_every_flush_rows_and_merge_in_job_order(tmp_path):
    out = tmp_path / "out.parquet"
    w = _writer(out, ["a", "b", "c"])
    w.add({"id": "c", "x": 3}, _made("c", "C"))
    assert list(partial_dir(out).glob("part-*")) == []
    w.add({"id": "a", "x": 1}, _made("a", "A"))
    assert len(list(partial_dir(out).glob("part-*.parquet"))) == 1  # both rows on disk now
    w.add({"id": "b", "x": "two"}, _made("b", "B"))  # x changes type
    assert not out.exists()
    table = w.finalize()
    assert out.exists() and not partial_dir(out).exists()
    assert table.column("id").to_pylist() == ["a", "b", "c"]
    assert table.column("generated_text").to_pylist() == ["A", "B", "C"]
    assert table.column("x").to_pylist() == ["1", "two", "3"]  # a clash is kept as text


def test_interrupted_parts_are_found_by_the_next_writer(tmp_path):
    out = tmp_path / "out.parquet"
    w = _writer(out, ["a", "b"], flush_rows=1)
    w.add({"id": "a"}, Result(id="a", status="error", error="boom", error_stage="fetch", input_hash=ROW))
    # The process dies here; a new run sees the part.
    w2 = _writer(out, ["a", "b"])
    assert w2.resume.done == {"a": ROW} and w2.resume.todo == 1
    w2.add({"id": "b"}, Result(id="b"))
    assert w2.finalize().column("status").to_pylist() == ["error", "ok"]


def test_parquet_input_schema_types_are_kept(tmp_path):
    out = tmp_path / "out.parquet"
    schema = pa.schema([("id", pa.int32()), ("score", pa.float32()), ("tags", pa.list_(pa.string()))])
    w = _writer(out, [1, 2], schema=schema)
    w.add({"id": 1, "score": 0.5, "tags": ["a"]}, Result(id=1))
    w.add({"id": 2, "score": None, "tags": []}, Result(id=2))
    w.finalize()
    t = pq.read_table(out)
    assert t.schema.field("score").type == pa.float32()
    assert t.schema.field("tags").type == pa.list_(pa.string())


def test_input_columns_named_like_ours_are_kept_aside(tmp_path):
    out = tmp_path / "out.parquet"
    w = _writer(out, ["a"])
    w.add({"id": "a", "status": "draft", "model": "human"}, Result(id="a", model="tiny"))
    t = w.finalize()
    row = t.to_pylist()[0]
    assert (row["input_status"], row["input_model"], row["status"], row["model"]) == (
        "draft",
        "human",
        "ok",
        "tiny",
    )


def test_resuming_under_other_settings_is_refused(tmp_path):
    import pytest

    from batchgen.core.errors import ConfigError

    out = tmp_path / "out.parquet"
    w = _writer(out, ["a"], flush_rows=1, settings={"model": "m1"})
    w.add({"id": "a"}, Result(id="a"))  # interrupted here, parts on disk
    with pytest.raises(ConfigError, match="model: 'm1' then, 'm2' now"):
        _writer(out, ["a"], settings={"model": "m2"})
    _writer(out, ["a"], settings={"model": "m1"}).finalize()
    with pytest.raises(ConfigError, match="other settings"):  # the finished output remembers them
        _writer(out, ["a"], settings={"model": "m2"})
    assert _writer(out, ["a"], settings={"model": "m2"}, overwrite=True).resume.done == {}


def test_a_resume_reads_the_job_from_the_mark_before_its_first_pending_row(tmp_path):
    path = tmp_path / "jobs.jsonl"
    lines = [json.dumps({"id": f"r{i}", "prompt": "Hi."}) for i in range(300)]
    path.write_text("".join(line + "\n" for line in lines))
    index = scan(path)
    assert [m.index for m in index.marks][:5] == [0, 64, 128, 192, 256]
    pending = Pending(index, {f"r{i}": index.rows.digest(i) for i in range(200)})
    # The finished part of the file, scrambled in place (same size): a reader from the start
    # would meet 192 lines that do not parse, each a row of its own; one that seeks never does.
    data = path.read_bytes()
    cut = sum(len(line) + 1 for line in lines[:192])
    path.write_bytes(b"".join(b"x" * len(line) + b"\n" for line in data[:cut].split(b"\n")[:-1]) + data[cut:])
    assert [r.id for r in pending.rows()] == [f"r{i}" for i in range(200, 300)]
    assert list(Pending(index, {}).rows())[0].error is not None  # from the start: the scrambled lines


def test_our_columns_are_a_rows_own_fields_and_its_generations_each_once():
    """The output's columns of ours: each field of a Result and of its Generation (the text as
    `generated_text`) once; a row comes back whole from its columns, as Ray hands it over."""
    from batchgen.core.records import GENERATED, RESULT_COLUMNS

    own = [f for f in Result.__dataclass_fields__ if f not in ("generation", "answer_kinds")]
    assert sorted(RESULT_COLUMNS) == sorted([*own, *GENERATED.values()])
    assert len(set(RESULT_COLUMNS)) == len(RESULT_COLUMNS) and "capped" not in RESULT_COLUMNS
    gen = Generation(text="t", finish_reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    made = Result(id="a", generation=gen, model="m", generate_ms=5.0, answer_kinds='{"x": "string"}')
    assert made.columns()["generated_text"] == "t" and made.columns()["cached_tokens"] == 1
    assert Result.from_columns({**made.columns(), "answer_kinds": made.answer_kinds}) == made
    failed = Result(id="b", status="error", error="x", error_stage="fetch")
    assert failed.columns()["prompt_tokens"] == 0 and failed.columns()["generated_text"] is None
    assert Result.from_columns({**failed.columns(), "answer_kinds": None}) == failed


def test_the_outputs_metadata_is_one_record_written_and_read_back_and_forged_values_are_none(tmp_path):
    out = tmp_path / "out.parquet"
    index = JobIndex("jsonl", Rows(["a", "b"], digests=bytes.fromhex(ROW) * 2), None)
    job = JobAbout(
        path="/data/job.jsonl", format="jsonl", id_column="key", image=("jpg",), not_carried=("jpg",)
    )
    about = About(media_base="/data", media=MediaAbout(local_paths=True, media_root="/data"), job=job)
    w = SingleFile(out, index, {"model": "m"}, WriteOptions(flush_rows=1, flush_seconds=3600), about=about)
    w.resume = Resume(w.open(), w.store, index, {"model": "m"}, max_attempts=3, every_failure=False)
    w.add({"id": "a"}, _made("a", "A"))
    w.finalize()
    back = About.of(pq.read_schema(out).metadata)
    # What the run wrote, the settings its rerun checks and where the output stands (a row pending).
    assert back == dataclasses.replace(
        about, settings={"model": "m"}, standing=Standing(complete=False, job_rows=2, pending=1)
    )
    forged = {
        **pq.read_schema(out).metadata,
        b"batchgen.job": json.dumps({"path": 7, "image": ["ok", {"x": 1}], "format": ["jsonl"]}).encode(),
        b"batchgen.complete": b'{"complete": "yes", "job_rows": -1, "pending": 1}',
        b"batchgen.media_policy": b"[1, 2]",
        b"batchgen.settings": b"\xff{",
    }
    read = About.of(forged)
    assert read.job == JobAbout(image=("ok",)) and read.standing is None
    assert read.media is None and read.settings is None and read.media_base == "/data"
    assert About.of(None) == About() and About().metadata() == {}

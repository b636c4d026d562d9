"""End to end through the CLI on the tiny checkpoints: no mocked engine anywhere."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, SAMPLE, batch, read, run_cli, unstamped, write_jsonl

from batchgen.core.records import RESULT_COLUMNS
from batchgen.execution.executor import ExecutorStats
from batchgen.execution.summary import RunSummary
from batchgen.generate.generator import GenerationStats

TEXT_ROWS = [
    {"id": "a", "prompt": "Say hello.", "topic": "greeting"},
    {"id": "b", "system": "Be brief.", "prompt": "Count to three.", "topic": "numbers", "max_tokens": 4},
    {"id": "c", "messages": [{"role": "user", "content": "What is MLX?"}], "topic": "tech"},
]
IMAGE_ROWS = [
    {"id": 1, "image": "media/red_circle.png", "prompt": "What shape is this?", "split": "val"},
    {"id": 2, "image": "media/red_circle.png", "prompt": "What colour is it?", "split": "val"},
    {"id": 3, "images": ["media/blue_square.webp"], "prompt": "Describe it.", "split": "test"},
    {
        "id": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "media/green_triangle_rotated.jpg"}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        "split": "test",
    },
]


def test_text_job(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", TEXT_ROWS)
    code, output = batch(job, workdir / "out.parquet")
    assert code == 0, output
    rows = read(workdir / "out.parquet")
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert [r["topic"] for r in rows] == ["greeting", "numbers", "tech"]
    for r in rows:
        assert r["status"] == "ok" and r["error"] is None and r["error_stage"] is None
        assert r["generated_text"]
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] > 0
        assert r["finish_reason"] in ("stop", "length")
        assert r["model"].endswith("tiny-lm")
        assert (r["cached_tokens"], r["mtp_drafts"], r["mtp_accepted"]) == (0, 0, 0)
    # Per-row max_tokens wins over the run default, and running out of budget is "length".
    assert rows[1]["completion_tokens"] <= 4
    assert all(r["finish_reason"] == "length" for r in rows if r["completion_tokens"] == 8)
    stats = json.loads((workdir / "out.parquet.stats.json").read_text())
    assert stats["rows"] == stats["ok"] == 3 and stats["failed"] == 0
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert not (workdir / "out.parquet.partial").exists()
    # The stats file is the summary's fields and the executors' figures it holds, generation's at
    # the top: each key from one record, none twice.
    names = [f for c in (RunSummary, ExecutorStats, GenerationStats) for f in c.__dataclass_fields__]
    assert set(stats) == set(names) - {"work", "generation"} and len(names) == len(set(names))
    assert stats["model_loads"] == 1 and stats["media"]["downloads"] == 0 and stats["one_at_a_time"] == {}


def test_an_executors_figures_cross_to_the_ray_driver_whole_and_add_up():
    """What an actor sends as JSON is what it had; several actors' figures add up field by field."""
    import json as js

    from batchgen.core.figures import CacheStats, MediaStats, MemoryStats

    gen = GenerationStats(
        cache=CacheStats(prefix_hits=3, prefix_misses=1, prompt_tokens_saved=40),
        max_tokens_capped=2,
        one_at_a_time={"video": 1},
        memory=MemoryStats(widths={4: 2}, out_of_memory=1),
        adapter_switches=5,
        model_loads=1,
        planned_aside=7,
    )
    one = ExecutorStats(
        media=MediaStats(downloads=2), generation=gen, unused_media={"jpg": 1}, near_misses={"max_token": 1}
    )
    back = ExecutorStats.from_json(js.loads(js.dumps(one.to_json())))
    assert back == one
    both = ExecutorStats.added([one, back])
    assert both.generation.planned_aside == 14 and both.generation.max_tokens_capped == 4
    assert both.generation.memory.widths == {4: 4} and both.generation.cache.prompt_tokens_saved == 80
    assert both.media.downloads == 4 and both.near_misses == {"max_token": 2}


def test_image_job_and_every_result_column(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", IMAGE_ROWS)
    code, output = batch(job, workdir / "out.parquet")
    assert code == 0, output
    table = pq.read_table(workdir / "out.parquet")
    assert set(RESULT_COLUMNS) <= set(table.column_names)
    assert table.schema.field("id").type == pa.int64()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [1, 2, 3, 4]
    assert [r["split"] for r in rows] == ["val", "val", "test", "test"]
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["model"].endswith("tiny-vlm")
        assert r["generated_text"] and r["completion_tokens"] > 0
        assert r["fetch_ms"] > 0 and r["decode_ms"] > 0 and r["generate_ms"] > 0
    # 4 image tokens + the chat frame: more than the same text alone would take.
    assert all(r["prompt_tokens"] > 8 for r in rows)


def test_parquet_job_gives_the_same_output_as_jsonl(workdir):
    rows = [{"id": r["id"], "prompt": r["prompt"], "image": r.get("image"), "n": i}
            for i, r in enumerate(IMAGE_ROWS[:3])]  # fmt: skip
    jsonl = write_jsonl(workdir / "jobs.jsonl", rows)
    parquet = workdir / "jobs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert batch(jsonl, workdir / "a.parquet")[0] == 0
    assert batch(parquet, workdir / "b.parquet")[0] == 0
    a, b = read(workdir / "a.parquet"), read(workdir / "b.parquet")
    assert [r["generated_text"] for r in a] == [r["generated_text"] for r in b]
    assert [r["n"] for r in b] == [0, 1, 2]


def test_mixed_job_keeps_input_order_and_greedy_is_deterministic(workdir):
    mixed = [TEXT_ROWS[0], {**IMAGE_ROWS[0], "id": "i1"}, TEXT_ROWS[1], {**IMAGE_ROWS[2], "id": "i2"}]
    job = write_jsonl(workdir / "jobs.jsonl", mixed)
    assert batch(job, workdir / "one.parquet")[0] == 0
    assert batch(job, workdir / "two.parquet")[0] == 0
    one, two = read(workdir / "one.parquet"), read(workdir / "two.parquet")
    assert [r["id"] for r in one] == ["a", "i1", "b", "i2"]
    assert [r["generated_text"] for r in one] == [r["generated_text"] for r in two]
    assert [r["completion_tokens"] for r in one] == [r["completion_tokens"] for r in two]


def test_sampling_with_a_seed_is_reproducible(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", [
        {"id": "t", "prompt": "Tell a story.", "temperature": 1.0, "seed": 7},
        {"id": "v", "image": "media/red_circle.png", "prompt": "Describe.", "temperature": 1.0, "seed": 7},
    ])  # fmt: skip
    assert batch(job, workdir / "one.parquet")[0] == 0
    assert batch(job, workdir / "two.parquet")[0] == 0
    assert [r["generated_text"] for r in read(workdir / "one.parquet")] == [
        r["generated_text"] for r in read(workdir / "two.parquet")
    ]


def test_stop_sequence_cuts_the_text(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": "a", "prompt": "Write a poem about the sea."}])
    assert batch(job, workdir / "free.parquet", "--max-tokens", "24")[0] == 0
    free = read(workdir / "free.parquet")[0]["generated_text"]
    stop = free[3:6]  # a piece that greedy decoding is known to produce
    assert stop and stop not in free[:3]
    assert batch(job, workdir / "cut.parquet", "--max-tokens", "24", "--stop", stop)[0] == 0
    cut = read(workdir / "cut.parquet")[0]
    assert free.startswith(cut["generated_text"]) and stop not in cut["generated_text"]
    assert cut["finish_reason"] == "stop"
    assert cut["completion_tokens"] < 24


def test_bad_rows_become_error_rows_and_the_run_goes_on(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", [
        {"id": "ok", "prompt": "Hi."},
        {"id": "no-prompt"},
        {"id": "bad-tokens", "prompt": "Hi.", "max_tokens": "ten"},
        "{not json",
        {"id": "missing", "image": "media/nope.png", "prompt": "What?"},
        {"id": "last", "prompt": "Bye."},
    ])  # fmt: skip
    code, output = batch(job, workdir / "out.parquet")
    assert code == 1, output
    rows = {r["id"]: r for r in read(workdir / "out.parquet")}
    # The unparseable line is named by its line number.
    assert list(rows) == ["ok", "no-prompt", "bad-tokens", "line-4", "missing", "last"]
    assert rows["line-4"]["error_stage"] == "read" and rows["line-4"]["error"].startswith("invalid JSON")
    assert rows["ok"]["status"] == rows["last"]["status"] == "ok"
    assert rows["no-prompt"]["error_stage"] == "read" and "prompt" in rows["no-prompt"]["error"]
    assert "max_tokens" in rows["bad-tokens"]["error"]
    assert rows["missing"]["error_stage"] == "fetch" and "media/nope.png" in rows["missing"]["error"]
    assert "1 failed" not in output and "4 failed" in output


def test_text_only_model_refuses_image_rows(workdir):
    from conftest import MODELS

    job = write_jsonl(workdir / "jobs.jsonl", [IMAGE_ROWS[0], TEXT_ROWS[0]])
    code, _ = run_cli("run", str(job), "-o", str(workdir / "o.parquet"), "--model", str(MODELS / "tiny-lm"),
                      "--temperature", "0", "--max-tokens", "4", "-q")  # fmt: skip
    assert code == 1
    img, text = read(workdir / "o.parquet")
    assert img["status"] == "error" and img["error_stage"] == "generate" and "text-only" in img["error"]
    assert text["status"] == "ok"


def test_not_json_exits_2_and_writes_nothing(workdir):
    job = workdir / "jobs.jsonl"
    job.write_bytes(b"id,prompt\n1,hello\n")
    code, output = batch(job, workdir / "out.parquet")
    assert code == 2
    assert "not a JSONL file" in output
    assert list(workdir.glob("out.parquet*")) == []


def test_unknown_model_is_a_usage_error(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", TEXT_ROWS[:1])
    code, output = run_cli(
        "run", str(job), "-o", str(workdir / "o.parquet"), "--model", str(workdir / "none")
    )
    assert code == 2 and "not a checkpoint folder" in output


def test_a_row_changed_under_a_finished_id_is_refused_by_its_place(workdir, scripted):
    rows = [{"id": f"r{i}", "prompt": f"Question {i}?"} for i in range(6)]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    assert batch(job, out, "--limit", "4")[0] == 0
    rows[2]["prompt"], rows[5]["prompt"] = "Another question?", "Not run yet, so free to change."
    job.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line
    code, output = batch(job, out)
    assert code == 2 and "1 row(s) changed since their results were written: line 4 (id 'r2')" in output
    assert [(r["id"], r["status"]) for r in read(out)] == [(f"r{i}", "ok") for i in range(4)]  # kept
    code, output = batch(job, out, "--limit", "5")  # a narrowed index names the same row
    assert code == 2 and "line 4 (id 'r2')" in output


def test_duplicate_ids_are_refused_before_any_work(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    code, output = batch(job, workdir / "out.parquet")
    assert code == 2 and "duplicate id 'x' at line 1 and line 2" in output
    assert list(workdir.glob("out.parquet*")) == []


def test_resume_after_limit_generates_only_the_rest(workdir, scripted):
    rows = [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(6)]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    assert batch(job, out, "--limit", "2")[0] == 0
    assert [r["id"] for r in read(out)] == ["r0", "r1"]
    first = read(out)

    code, output = batch(job, out)
    assert code == 0 and "(2 resumed)" in output
    final = read(out)
    assert [r["id"] for r in final] == [f"r{i}" for i in range(6)]
    assert final[:2] == first  # resumed rows are kept as they were, timings included

    # A finished output is left alone by a rerun, byte for byte.
    before = out.read_bytes()
    code, output = batch(job, out)
    assert code == 0 and "(6 resumed)" in output and out.read_bytes() == before

    # --overwrite starts over.
    code, output = batch(job, out, "--overwrite")
    assert code == 0 and "(0 resumed)" in output
    assert [r["generated_text"] for r in read(out)] == [r["generated_text"] for r in final]


def test_fail_fast_stops_and_a_rerun_resumes(workdir, scripted):
    rows = [{"id": "a", "prompt": "One."}, {"id": "b"}, {"id": "c", "prompt": "Three."}]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = batch(job, out, "--fail-fast")
    assert code == 1 and "line 2" in output and "--fail-fast" in output
    assert not out.exists()  # finished rows, if any, wait in out.parquet.partial for the rerun
    write_jsonl(job, [rows[0], {"id": "b", "prompt": "Two."}, rows[2]])  # the user fixes the row
    code, output = batch(job, out, "--fail-fast")
    assert code == 0, output
    assert [r["status"] for r in read(out)] == ["ok", "ok", "ok"]


def test_empty_job_file_gives_an_empty_output_with_the_schema(workdir, scripted):
    job = workdir / "jobs.jsonl"
    job.write_text("\n\n")
    assert batch(job, workdir / "out.parquet")[0] == 0
    table = pq.read_table(workdir / "out.parquet")
    assert table.num_rows == 0 and set(RESULT_COLUMNS) <= set(table.column_names)


def test_the_bundled_sample_runs_with_the_default_config(tmp_path, monkeypatch):
    monkeypatch.chdir(SAMPLE.parent)
    out = tmp_path / "results.parquet"
    code, output = run_cli("run", "sample_data/jobs.jsonl", "-o", str(out), "--max-tokens", "8", "-q")
    assert code == 0, output
    rows = read(out)
    assert len(rows) == sum(1 for line in (SAMPLE / "jobs.jsonl").read_text().splitlines() if line.strip())
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    models = ROOT / "sample_data" / "models"  # recorded absolute: the same from any folder
    assert {r["model"] for r in rows} == {str(models / "tiny-lm"), str(models / "shapes-vlm")}
    # The trained captioner answers the sample's shapes rows right.
    shapes = [r for r in rows if r.get("expected")]
    assert len(shapes) == 18 and all(r["generated_text"].strip() == r["expected"] for r in shapes)


def test_image_job_over_http(workdir):
    from mediaserver import MediaServer

    with MediaServer(workdir / "media") as server:
        rows = [
            {"id": "a", "image": f"{server.url}/img/red_circle.png", "prompt": "Shape?"},
            {"id": "b", "image": f"{server.url}/redirect?to=/img/blue_square.webp", "prompt": "Colour?"},
            {"id": "c", "video": f"{server.url}/video", "prompt": "What moves?"},
            {"id": "d", "image": f"{server.url}/img/missing.png", "prompt": "?"},
        ]
        job = write_jsonl(workdir / "jobs.jsonl", rows)
        code, output = batch(job, workdir / "out.parquet", "--allow-private-urls")
        assert code == 1, output
        out = {r["id"]: r for r in read(workdir / "out.parquet")}
        assert [out[k]["status"] for k in "abc"] == ["ok", "ok", "ok"], [out[k]["error"] for k in "abc"]
        assert out["c"]["frames_ms"] > 0
        assert out["d"]["error_stage"] == "fetch" and "HTTP 404" in out["d"]["error"]
        assert "/img/missing.png" in out["d"]["error"]

        # Without the opt-in, loopback is refused with a clear row error and never contacted.
        hits = sum(server.hits.values())
        code, _ = batch(job, workdir / "refused.parquet")
        assert code == 1 and sum(server.hits.values()) == hits
        for r in read(workdir / "refused.parquet"):
            assert r["status"] == "error" and r["error_stage"] == "fetch"
            assert "refused" in r["error"] and "--allow-private-urls" in r["error"]


def test_shared_image_is_fetched_once_per_url_and_decoded_once(workdir):
    from mediaserver import MediaServer

    png = (workdir / "media" / "red_circle.png").read_bytes()
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    with MediaServer(workdir / "media") as server:
        url = f"{server.url}/img/red_circle.png"
        refs = [url, "media/red_circle.png", data_url, f"{server.url}/redirect?to=/img/red_circle.png"]
        rows = [{"id": i, "image": refs[i % 4], "prompt": f"Question {i}?"} for i in range(20)]
        job = write_jsonl(workdir / "jobs.jsonl", rows)
        code, output = batch(job, workdir / "out.parquet", "--allow-private-urls", "--max-tokens", "2")
        assert code == 0, output
        assert server.hits["/img/red_circle.png"] == 2  # once per URL: direct, and via the redirect
        assert server.hits["/redirect"] == 1
    media = json.loads((workdir / "out.parquet.stats.json").read_text())["media"]
    assert media["downloads"] == 2 and media["url_reuses"] == 8
    assert media["image_decodes"] == 1 and media["image_decode_reuses"] == 19


def test_audio_needs_an_audio_model_and_temp_files_are_removed(workdir, monkeypatch):
    import tempfile
    import wave

    with wave.open(str(workdir / "tone.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    video = base64.b64encode((workdir / "media" / "moving_dot.mp4").read_bytes()).decode()
    job = write_jsonl(workdir / "jobs.jsonl", [
        {"id": "a", "audio": "tone.wav", "prompt": "What do you hear?"},
        {"id": "v", "video": f"data:video/mp4;base64,{video}", "prompt": "What moves?"},
    ])  # fmt: skip
    scratch = workdir / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, _ = batch(job, workdir / "out.parquet")
    assert code == 1
    audio, video_row = read(workdir / "out.parquet")
    assert audio["error_stage"] == "generate" and "no audio encoder" in audio["error"]
    assert video_row["status"] == "ok" and video_row["frames_ms"] > 0
    assert list(scratch.iterdir()) == []  # the spilled data-URL video is gone


def test_bad_output_paths_exit_2_before_any_work(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"prompt": "Hi."}])
    (workdir / "afile").write_text("x")
    (workdir / "adir").mkdir()
    for out, fragment in [
        (f"{workdir / 'afile'}/", "a file, not a folder"),  # shards asked for in a file
        (f"{workdir}/", "the job's files are in it"),  # shards beside the job would be read as job files
        (workdir / "afile" / "out.parquet", "cannot write"),
        ("/proc/batchgen/out.parquet", "cannot create the lock"),
    ]:
        code, output = batch(job, out)
        assert code == 2 and fragment in output, (out, output)
        assert "Traceback" not in output


def test_the_job_file_is_never_an_output(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"prompt": "Hi."}])
    before = job.read_bytes()
    code, output = batch(job, job, "--overwrite")
    assert code == 2 and "is the job file itself" in output
    code, output = batch(job, job, "--output-format", "openai", "--overwrite")
    assert code == 2 and "is the job file itself" in output
    assert job.read_bytes() == before


def test_a_limit_never_removes_finished_rows(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(6)])
    out = workdir / "out.parquet"
    assert batch(job, out)[0] == 0
    before = out.read_bytes()
    code, output = batch(job, out, "--limit", "2")
    assert code == 0, output
    assert [r["id"] for r in read(out)] == [f"r{i}" for i in range(6)] and out.read_bytes() == before


def test_a_utf8_bom_is_not_part_of_the_first_row_or_the_header(workdir, scripted):
    jsonl = workdir / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "prompt": "Hi."}\n{"id": "b", "prompt": "Yo."}\n')
    csv_file = workdir / "bom.csv"
    csv_file.write_bytes(b"\xef\xbb\xbfid,prompt\nx,Hi.\ny,Yo.\n")
    for job, ids in ((jsonl, ["a", "b"]), (csv_file, ["x", "y"])):
        code, output = batch(job, workdir / f"{job.stem}.parquet")
        assert code == 0, output
        rows = read(workdir / f"{job.stem}.parquet")
        assert [r["id"] for r in rows] == ids and all(r["status"] == "ok" for r in rows)


def test_invalid_utf8_in_a_parquet_string_is_that_rows_error(workdir, scripted):
    prompts = pa.array([b"Fine.", b"caf\xe9", b"Also fine."], pa.binary()).view(pa.string())
    job = workdir / "jobs.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": prompts}), job)
    code, output = batch(job, workdir / "out.parquet")
    assert code == 1, output
    rows = read(workdir / "out.parquet")
    assert [(r["id"], r["status"]) for r in rows] == [("a", "ok"), ("b", "error"), ("c", "ok")]
    assert rows[1]["error_stage"] == "read" and "column 'prompt': not valid UTF-8" in rows[1]["error"]
    assert rows[1]["prompt"] == "caf\ufffd"
    code, report = run_cli("validate", str(job))
    assert code == 1 and "row 1: row: column 'prompt': not valid UTF-8" in report


def test_a_huge_csv_cell_is_a_row_not_an_unreadable_file(workdir):
    job = workdir / "jobs.csv"
    job.write_text("id,prompt\nbig," + "word " * 40_000 + "\nsmall,Hi.\n")
    code, output = batch(job, workdir / "out.parquet")
    assert code == 1, output
    rows = read(workdir / "out.parquet")
    assert [(r["id"], r["status"]) for r in rows] == [("big", "error"), ("small", "ok")]
    assert "cannot fit the model's context" in rows[0]["error"]


@pytest.mark.slow  # 300 rows before the failing load (2 s)
@pytest.mark.parametrize("media_at", [0, 299])
def test_a_model_that_cannot_load_stops_the_run_with_2_before_any_row_and_6_after(workdir, media_at):
    broken = workdir / "broken-vlm"
    shutil.copytree(SAMPLE / "models" / "tiny-vlm", broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    rows = [{"id": f"t{i}", "prompt": f"Row {i}."} for i in range(299)]
    rows.insert(media_at, {"id": "media", "image": "media/red_circle.png", "prompt": "What is it?"})
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = batch(job, out, "--model", str(broken), "--max-tokens", "2")
    assert code == (6 if media_at else 2) and "mlx-vlm cannot load it" in output, output
    assert not out.exists()
    if media_at:  # the text rows of the first window were finished and are kept for the rerun
        parts = list((workdir / "out.parquet.partial").glob("part-*.parquet"))
        assert sum(pq.read_metadata(p).num_rows for p in parts) >= 256
        assert "rerun to resume" in output


def test_a_run_resumes_from_another_folder(workdir, monkeypatch, scripted):
    """Model paths are kept as absolute paths, so the same job resumed from elsewhere (with the
    model named relative to that folder) is the same run; a changed setting is named alone."""
    import os

    rows = [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(4)]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    monkeypatch.chdir(ROOT)
    models = ("--model", "sample_data/models/tiny-vlm", "--text-model", "sample_data/models/tiny-lm")
    common = ("run", str(job), "-o", str(out), "--temperature", "0", "--max-tokens", "3", "-q", *models)
    assert run_cli(*common, "--limit", "2")[0] == 0
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = os.path.relpath(ROOT / "sample_data" / "models", elsewhere)
    moved = [a.replace("sample_data/models", relative) for a in common]
    code, output = run_cli(*moved)
    assert code == 0 and "(2 resumed)" in output, output
    code, output = run_cli(*moved, "--max-tokens", "4")
    assert code == 2 and "other settings (generation.max_tokens: 3 then, 4 now)" in output
    assert "model:" not in output


def test_a_rerun_with_nothing_to_do_keeps_the_last_runs_figures(workdir, scripted):
    import json

    job = write_jsonl(workdir / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(3)])
    out = workdir / "out.parquet"
    assert batch(job, out)[0] == 0
    stats = workdir / "out.parquet.stats.json"
    first = json.loads(stats.read_text())
    assert first["generated"] == 3 and first["tokens_per_s"] > 0
    code, output = batch(job, out)
    assert code == 0 and "(3 resumed)" in output
    again = json.loads(stats.read_text())
    assert again["tokens_per_s"] == first["tokens_per_s"] and again["generated"] == 3 and "last_noop" in again
    code, summary = run_cli("inspect", str(out))
    assert f"last run {first['tokens_per_s']:.1f} tok/s" in summary


def test_without_a_terminal_progress_lines_come_at_a_steady_pace(workdir, monkeypatch):
    """Under cron stderr is no terminal: no bar, but a progress line every `progress_seconds`;
    options come from the environment too (BATCHGEN_RUN_…)."""
    import re

    job = write_jsonl(workdir / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(24)])
    preset = workdir / "cron.yaml"
    preset.write_text("progress_seconds: 0.2\n")
    monkeypatch.setenv("BATCHGEN_RUN_MAX_TOKENS", "12")
    out = workdir / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "--model",
                           str(ROOT / "sample_data/models/tiny-vlm"), "--text-model",
                           str(ROOT / "sample_data/models/tiny-lm"), "--batch-size", "1")  # fmt: skip
    assert code == 0, output
    lines = [line for line in output.splitlines() if " INFO progress: " in line]
    assert len(lines) >= 2, output
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO "
    rates = r"\d+\.\d\d rows/s, \d+ tok/s, (prefix hits \d+%, )?0 failed"
    pattern = stamp + r"progress: \d+/24 rows \(\d+\.\d%\), " + rates + r", ETA \S+"
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    assert {r["completion_tokens"] for r in read(out)} <= set(range(1, 13)) and max(
        r["completion_tokens"] for r in read(out)
    ) == 12  # the environment's max_tokens


def test_the_summary_names_the_commonest_errors_and_inspect_refuses_other_parquet(workdir, scripted):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"m{i}", "image": "media/missing.png", "prompt": "What?"} for i in range(3)]
    rows += [{"id": "bad", "prompt": 5}, {"id": "fine", "prompt": "Hi."}]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    code, output = batch(job, workdir / "out.parquet")
    assert code == 1
    line = next(x for x in output.splitlines() if "commonest errors" in x)
    assert (
        "commonest errors: 3× fetch: no such file" in line
        and "1× read: prompt: expected a string, got 5" in line
    )
    pq.write_table(pa.table({"a": [1, 2]}), workdir / "other.parquet")
    for command in (["inspect"], ["report", "-o", str(workdir / "page.html")]):
        code, output = run_cli(*command[:1], str(workdir / "other.parquet"), *command[1:])
        assert code == 2 and "not a batchgen results file (no id, status, error" in output
        assert "Traceback" not in output and "KeyError" not in output


def test_an_internal_crash_has_its_own_exit_code_and_a_traceback_file(workdir, monkeypatch, scripted):
    import batchgen.execution.runner

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(batchgen.execution.runner, "_conclude", broken)
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    code, output = batch(job, workdir / "out.parquet")
    assert code == 3, output
    line = unstamped(output.strip().splitlines()[-1])
    assert line.startswith("error: internal error RuntimeError: a bug in the writer (full traceback in ")
    path = line.split("full traceback in ", 1)[1].split(")", 1)[0]
    text = Path(path).read_text()
    assert "Traceback" in text and "a bug in the writer" in text and "_run" in text
    os.remove(path)


def test_failed_rows_are_retried_across_runs_up_to_max_attempts(workdir, network, scripted):
    """Cron: a row that failed while its server was down succeeds on the rerun once the server
    is back; with the server down it stays failed after three attempts; a 404 is no transient
    failure and is not tried again; --retry-failed tries every failed row again."""
    from mediaserver import MediaServer

    with MediaServer(workdir / "media") as server:
        rows = [
            {"id": "remote", "image": f"{server.url}/img/red_circle.png", "prompt": "What?"},
            {"id": "gone", "image": f"{server.url}/img/missing.png", "prompt": "What?"},
            {"id": "text", "prompt": "Hi."},
        ]
        job = write_jsonl(workdir / "jobs.jsonl", rows)
        quick = ("--allow-private-urls", "--config", str(_fast_retries(workdir)))

        def attempts(out):
            return {r["id"]: (r["status"], r["attempts"], r["transient"]) for r in read(out)}

        server.down = True  # 503 for everything
        back = workdir / "back.parquet"
        assert batch(job, back, *quick)[0] == 1
        assert attempts(back) == {
            "remote": ("error", 1, True),
            "gone": ("error", 1, True),
            "text": ("ok", 1, False),
        }
        server.down = False
        code, output = batch(job, back, *quick)
        assert code == 1 and "(1 resumed)" in output  # the text row; both failures tried again
        assert attempts(back) == {
            "remote": ("ok", 2, False),
            "gone": ("error", 2, False),
            "text": ("ok", 1, False),
        }
        code, output = batch(job, back, *quick)  # the 404 is not transient: nothing to do
        assert code == 1 and "(3 resumed)" in output and attempts(back)["gone"] == ("error", 2, False)

        server.down = True
        stays = workdir / "stays.parquet"
        for _ in range(4):
            assert batch(job, stays, *quick)[0] == 1
        assert attempts(stays)["remote"] == ("error", 3, True)  # three attempts, then left alone
        server.down = False
        assert batch(job, stays, *quick)[0] == 1 and attempts(stays)["remote"] == ("error", 3, True)
        assert batch(job, stays, *quick, "--retry-failed")[0] == 1
        assert attempts(stays) == {
            "remote": ("ok", 4, False),
            "gone": ("error", 4, False),
            "text": ("ok", 1, False),
        }

        server.down = True  # into a folder of shards: the retried row's old record goes
        shards = workdir / "shards"
        assert batch(job, f"{shards}/", *quick)[0] == 1
        server.down = False
        assert batch(job, f"{shards}/", *quick)[0] == 1
        table = pq.read_table(shards).to_pylist()
        assert sorted((r["id"], r["status"], r["attempts"]) for r in table) == [
            ("gone", "error", 2), ("remote", "ok", 2), ("text", "ok", 1)]  # fmt: skip


def _fast_retries(folder):
    preset = folder / "fast.yaml"
    preset.write_text("media: {retries: 1}\n")  # one attempt a run: the test is about runs
    return preset


def test_a_slim_output_leaves_out_how_rows_were_made_and_still_resumes(workdir, scripted):
    rows = [
        {"id": f"r{i}", "prompt": f"Item {i}.", **({"script": "fail"} if i == 3 else {})} for i in range(5)
    ]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = batch(
        job, out, "--limit", "4", "--result-columns", "slim", "--drop-result-columns", "choices"
    )
    assert code == 1, output  # r3 failed
    names = pq.read_table(out).column_names
    assert names == ["id", "prompt", "script", "status", "generated_text", "reasoning", "tool_calls",
                     "error", "error_stage", "adapter", "adapter_sha256", "attempts", "transient", "parsed",
                     "logprobs", "choice_scores", "score_logprob", "score_mean", "score_tokens", "input_hash",
                     "media_files"]  # fmt: skip
    code, output = batch(
        job, out, "--result-columns", "slim", "--drop-result-columns", "choices", "--retry-failed"
    )
    assert code == 1 and "5 rows: 4 ok, 1 failed (3 resumed)" in output, output
    final = {r["id"]: r for r in read(out)}
    assert final["r3"]["attempts"] == 2 and final["r4"]["generated_text"] == "scripted answer to r4"
    assert pq.read_table(out).column_names == names
    code, output = run_cli("export", str(out), "--format", "jsonl", "-o", str(workdir / "rows.jsonl"))
    assert code == 0 and "wrote 5 (1 failed)" in output, output
    text = run_cli("inspect", str(out))[1]
    assert "1 failed" in text and "tokens:" not in text and "slowest rows" not in text  # not recorded
    code, output = batch(job, out, "--drop-result-columns", "input_hash")
    assert code == 2 and "--drop-result-columns 'input_hash': every output keeps it" in output
    code, output = batch(job, out, "--drop-result-columns", "nope")
    listed = "not one of batchgen's columns (these can go: generated_text, reasoning, tool_calls, finish_"
    assert code == 2 and listed in output


def test_a_limited_run_says_it_is_incomplete_everywhere(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(6)])
    out = workdir / "out.parquet"
    code, output = batch(job, out, "--limit", "2")
    assert code == 0 and "incomplete: 2 of 6 rows, 4 pending (rerun without --limit to finish)" in output
    stats = json.loads((workdir / "out.parquet.stats.json").read_text())
    assert (stats["complete"], stats["pending"], stats["job_rows"]) == (False, 4, 6)
    meta = json.loads(pq.read_schema(out).metadata[b"batchgen.complete"])
    assert meta == {"complete": False, "pending": 4, "job_rows": 6}
    assert "incomplete: 2 of 6 rows, 4 pending" in run_cli("inspect", str(out))[1]
    code, output = batch(job, out)
    assert code == 0 and "incomplete" not in output
    assert json.loads(pq.read_schema(out).metadata[b"batchgen.complete"])["complete"] is True
    assert json.loads((workdir / "out.parquet.stats.json").read_text())["complete"] is True
    assert "incomplete" not in run_cli("inspect", str(out))[1]

    folder = workdir / "shards"  # a shard folder says it in its _stats.json
    code, output = batch(job, folder, "--output-shards", "--limit", "3")
    assert code == 0 and "incomplete: 3 of 6 rows, 3 pending" in output
    assert "incomplete: 3 of 6 rows" in run_cli("inspect", str(folder))[1]


def test_a_rerun_with_nothing_to_do_says_so_and_a_refusal_names_only_what_changed(workdir, scripted):
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    out = workdir / "out.parquet"
    assert batch(job, out, "--max-tokens", "48")[0] == 0
    code, output = batch(job, out, "--max-tokens", "48")
    assert code == 0 and "1 row: 1 ok, 0 failed (1 resumed) · nothing to do" in output, output
    assert f"up to date: {out}" in output and "rows/s" not in output and "wrote" not in output
    code, output = batch(job, out, "--max-tokens", "5")
    assert code == 2 and "generation.max_tokens: 48 then, 5 now" in output, output
    assert "temperature" not in output  # the other parameters did not change

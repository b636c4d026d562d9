from __future__ import annotations

import click
from conftest import run_cli, write_jsonl

from batchgen.cli.commands import main


def test_validate_reports_every_problem_with_its_line(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": 1, "prompt": "fine"},
        {"id": 2, "prompt": "x", "max_tokens": "ten", "temperature": -1},
        "",
        "{broken",
        {"id": 4, "messages": [{"role": "user", "content": [{"type": "sticker", "url": "x"}]}]},
        {"id": 1, "prompt": "again"},
        {"id": 6, "images": 5, "prompt": "x"},
        ["not", "an", "object"],
    ])  # fmt: skip
    code, output = run_cli("validate", str(job))
    assert code == 1
    lines = output.splitlines()
    assert f"{job}:2: max_tokens: expected a positive integer, got 'ten'" in lines
    assert f"{job}:2: temperature: expected a number >= 0, got -1" in lines
    assert any(line.startswith(f"{job}:4: row: invalid JSON") for line in lines)
    assert f"{job}:5: messages[0].content[0]: unknown content part type 'sticker'" in lines
    assert f"{job}:6: id: duplicate id 1 (first at line 1)" in lines
    assert any(line.startswith(f"{job}:7: images: expected a URL, path, data URL, bytes") for line in lines)
    assert f"{job}:8: row: expected a JSON object, got list" in lines
    # Lines that are no JSON object are named by their line, so they never clash with ids.
    assert not any("duplicate id 2" in line or "duplicate id 6" in line for line in lines)
    assert "7 problems in " in output and "(7 rows read)" in output


def test_validate_clean_file_exits_0(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "a"}, {"prompt": "b", "stop": ["\n"]}])
    code, output = run_cli("validate", str(job))
    assert code == 0 and "ok" in output


def test_validate_unreadable_file_exits_2(tmp_path):
    job = tmp_path / "jobs.parquet"
    job.write_text("this is not parquet")
    code, output = run_cli("validate", str(job))
    assert code == 2 and "not a readable Parquet file" in output
    code, output = run_cli("validate", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "no such job file" in output


def test_validate_counts_repeats_checks_media_numbers_rows_per_file_and_warns_of_slips(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "there.png").write_bytes(b"")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"]}), shards / "00000.parquet")
    rows = {"id": ["c", "d", "e", "f", "g"], "prompt": ["x", None, None, None, "y"],
            "image": ["there.png", None, None, None, "nope.png"], "max_token": [5, 5, 5, 5, 5]}  # fmt: skip
    pq.write_table(pa.table(rows), shards / "00001.parquet")
    code, output = run_cli("validate", str(shards))
    assert code == 1, output
    lines = output.splitlines()
    f1 = "00001.parquet"  # as the folder names it
    assert (f"{f1}: row 1: prompt: missing: a row needs 'prompt' or 'messages' (3 rows alike; also "
            "row 2, row 3)") in lines  # fmt: skip
    assert f"{f1}: row 4: image: no such file 'nope.png'" in lines  # the first file's rows count from 0
    assert (f"{f1}: warning: field 'max_token': in 5 rows, not one batchgen reads (did you mean "
            "'max_tokens'? it is kept as data)") in lines  # fmt: skip
    assert not any("there.png" in line or "00000.parquet" in line for line in lines)
    assert "4 problems in " in output


def test_a_run_warns_once_of_a_field_one_slip_from_one_it_reads(tmp_path, scripted):
    rows = [
        {"id": f"r{i}", "prompt": "x", "max_token": 5, "imgae": "x.png", "caption": "kept"} for i in range(3)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, output = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), "--model", "m")
    assert code == 0, output
    assert output.count("field 'max_token' is not one batchgen reads; did you mean 'max_tokens'?") == 1
    assert output.count("field 'imgae' is not one batchgen reads; did you mean 'image'?") == 1
    assert (
        "3 rows with field 'max_token', which batchgen does not read (did you mean 'max_tokens'?)" in output
    )
    assert "3 rows with field 'imgae'" in output and "'caption'" not in output
    code, output = run_cli("run", str(job), "-o", str(tmp_path / "p.parquet"), "--model", "m",
                           "--prompt-template", "{imgae}")  # fmt: skip
    assert code == 0 and "imgae" not in output.replace("{imgae}", "")  # a template's field is meant


def test_validate_names_a_column_that_looks_like_media_and_counts_rows_on_success(tmp_path):
    job = write_jsonl(
        tmp_path / "jobs.jsonl", [{"id": i, "prompt": "x", "jpg": f"{i}.png"} for i in range(3)]
    )
    code, output = run_cli("validate", str(job))
    assert code == 0, output
    assert (f"{job}: warning: column 'jpg': looks like media, beside 3 rows without media; "
            "--image-column jpg or --video-column jpg to use it") in output  # fmt: skip
    assert output.rstrip().endswith(f"{job}: ok, 3 rows")
    options = [p for p in main.commands["validate"].params if isinstance(p, click.Option)]
    assert len(options) == 8 and all(o.help for o in options)  # every option says what it is
    assert "Column holding images" in run_cli("validate", "--help")[1]

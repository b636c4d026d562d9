from __future__ import annotations

from conftest import run_cli, write_jsonl


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
    assert "7 problem(s)" in output


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

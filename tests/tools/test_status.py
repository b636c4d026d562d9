"""`status` on a folder of shards and on several outputs, and `inspect --failed`, on runs made
in this process (the subprocess lifecycle is tests/execution/test_cron.py's)."""

from __future__ import annotations

import json

from conftest import read, run_cli, write_jsonl

MODEL = ("--model", "scripted")


def _jobs(folder, sizes: dict[str, int], failing: set[str] = frozenset()):
    folder.mkdir()
    for name, n in sizes.items():
        rows = [{"id": f"{name}-{i}", "prompt": f"Row {i}."} for i in range(n)]
        for row in rows:
            if row["id"] in failing:
                row["script"] = "fail"
        write_jsonl(folder / f"{name}.jsonl", rows)
    return folder


def test_status_of_a_shard_folder_counts_each_shard_and_the_whole(tmp_path, scripted):
    jobs = _jobs(tmp_path / "jobs", {"a": 3, "b": 2}, failing={"b-0"})
    out = tmp_path / "out"
    code, output = run_cli("run", str(jobs), "-o", f"{out}/", *MODEL, "--limit", "4")
    assert code == 1, output
    code, text = run_cli("status", f"{out}/")
    assert code == 4, text  # incomplete: one row left
    lines = text.splitlines()
    assert lines[0] == f"{out}: incomplete · 4 of 5 rows, 1 pending; 3 ok, 1 failed (generate 1)"
    assert "  shard a.parquet: 3 rows, 3 ok, 0 failed" in lines
    assert "  shard b.parquet: 1 row, 0 ok, 1 failed" in lines
    assert "ended incomplete (--limit, or rows added since)" in text
    code, output = run_cli("run", str(jobs), "-o", f"{out}/", *MODEL)
    code, text = run_cli("status", str(out), "--json")
    status = json.loads(text)
    assert code == 1 and status["state"] == "complete" and status["exit_code"] == 1  # complete, a row failed
    shards = [(s["name"], s["rows"], s["failed"]) for s in status["shards"]]
    assert shards == [("a.parquet", 3, 0), ("b.parquet", 2, 1)]
    assert status["errors_by_stage"] == {"generate": 1} and status["rows"] == 5


def test_status_of_several_outputs_shows_each_then_the_total(tmp_path, scripted):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(6)])
    outs = [tmp_path / f"out-{i}.parquet" for i in range(2)]
    for i, out in enumerate(outs):
        code, output = run_cli("run", str(job), "-o", str(out), *MODEL, "--shard", f"{i}/2")
        assert code == 0, output
    code, text = run_cli("status", *map(str, outs))
    counts = [int(line.split(" · ")[1].split()[0]) for line in text.splitlines() if ": complete · " in line]
    assert code == 0 and len(counts) == 2 and sum(counts) == 6, text
    assert text.rstrip().endswith("total: 6 rows, 6 ok, 0 failed, 0 pending")
    code, text = run_cli("status", *map(str, outs), "--json")
    both = json.loads(text)
    assert [o["output"] for o in both["outputs"]] == list(map(str, outs))
    assert both["total"] == {"rows": 6, "ok": 6, "failed": 0, "pending": 0, "job_rows": 6, "exit_code": 0}


def test_inspect_failed_lists_every_failed_row_with_its_error(tmp_path, scripted):
    rows = [{"id": "a", "prompt": "Hi."}, {"id": "b\tc", "prompt": "Hi.", "script": "fail"},
            {"id": "d", "image": "missing.png", "prompt": "What?"}]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    assert run_cli("run", str(job), "-o", str(out), *MODEL)[0] == 1
    code, text = run_cli("inspect", str(out), "--failed")
    assert code == 0 and text.splitlines() == [
        "b\\tc\tgenerate\tscripted failure",  # a tab in an id cannot split its line
        f"d\tfetch\tmissing.png: no such file ({tmp_path / 'missing.png'})",
    ]
    code, text = run_cli("inspect", str(out), "--failed", "--json")
    listed = [json.loads(line) for line in text.splitlines()]
    failed = [r for r in read(out) if r["status"] == "error"]
    assert listed == [{"id": r["id"], "stage": r["error_stage"], "error": r["error"],
                       "attempts": r["attempts"], "transient": r["transient"]} for r in failed]  # fmt: skip
    errors = [json.loads(line) for line in (tmp_path / "out.parquet.errors.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in e.items() if k != "this_run"} for e in errors] == listed


def test_an_output_named_without_a_folder_keeps_its_heartbeat_beside_it(tmp_path, scripted, monkeypatch):
    """`-o results.parquet` in the current folder, as the README's first command: the heartbeat
    is a file beside the output (it was once made a folder of that name), and status reads it."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(3)])
    code, output = run_cli("run", "jobs.jsonl", "-o", "results.parquet", *MODEL)
    assert code == 0 and "heartbeat" not in output, output
    beat = json.loads((tmp_path / "results.parquet.heartbeat.json").read_text())
    assert beat["state"] == "complete" and beat["done"] == 3, beat
    code, text = run_cli("status", "results.parquet")
    assert code == 0 and text.startswith("results.parquet: complete · 3 rows"), text

"""A job's lifecycle as cron lives it, in real runs in subprocesses without a terminal: status
while it runs and after, a time limit and the rerun that completes it, the error file, exit
codes that tell tonight's failures from old ones, and every stderr line stamped."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import MODELS, STAMP, read, write_jsonl

pytestmark = pytest.mark.slow  # a subprocess per run: MLX and transformers imported each time

LM = str(MODELS / "tiny-lm")
LINE = re.compile(rf"^{STAMP} (INFO|WARNING|ERROR|DEBUG) ")


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)  # fmt: skip


def _start(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def _stamped(stderr: str) -> None:
    lines = stderr.splitlines()
    assert lines and all(LINE.match(line) for line in lines), stderr


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{i:03d}", "prompt": f"Tell me about item {i}."} for i in range(n)]


def _run(job, out, *extra):
    return _cli("run", str(job), "-o", str(out), "--model", LM, "--temperature", "0", *extra)


def test_status_follows_a_run_in_progress_and_says_how_it_ended(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", _rows(240))
    out = tmp_path / "out.parquet"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    env["BATCHGEN_RUN_MAX_TOKEN"] = "4"  # a typo: warned about, stamped like every line
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out), "--model", LM,
           "--temperature", "0", "--max-tokens", "24", "--batch-size", "4", "--static-batches"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    seen = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # until a batch is committed
        now = _cli("status", str(out), "--json")
        if now.returncode == 5 and json.loads(now.stdout)["last_run"]["done"] > 0:
            seen, text = json.loads(now.stdout), _cli("status", str(out))
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert seen is not None, "status never showed the run in progress"
    beat = seen["last_run"]
    assert seen["state"] == "running" and seen["exit_code"] == 5
    assert beat["pid"] == proc.pid and beat["todo"] == 240 and 0 < beat["done"] < 240
    assert beat["rows_per_s"] > 0 and beat["eta"] and beat["last_commit"]
    assert text.returncode == 5 and text.stdout.startswith(f"{out}: running\n"), text.stdout
    assert f"pid {proc.pid} on " in text.stdout and " of 240 rows to do committed (" in text.stdout
    assert "ETA " in text.stdout and "last committed batch: 20" in text.stdout
    # SIGTERM: the run says so (stamped), and status says how it ended.
    assert proc.returncode == 143 and "ERROR error: stopped by SIGTERM" in stderr, stderr
    assert "WARNING warning: BATCHGEN_RUN_MAX_TOKEN is not a batchgen variable" in stderr
    _stamped(stderr)
    after = _cli("status", str(out), "--json")
    stopped = json.loads(after.stdout)
    assert after.returncode == 4 and stopped["state"] == "incomplete" and stopped["exit_code"] == 4
    assert stopped["last_run"]["state"] == "interrupted" and stopped["rows"] >= beat["done"]
    assert stopped["rows"] + stopped["pending"] == 240
    text = _cli("status", str(out))
    assert (
        "ended stopped (SIGINT or SIGTERM) at 20" in text.stdout and "rerun the same command" in text.stdout
    )
    nothing = _cli("status", str(tmp_path / "none.parquet"))
    assert nothing.returncode == 2 and "no batchgen run has written here" in nothing.stderr


def test_a_time_limit_stops_early_and_the_rerun_completes_each_id_once(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", _rows(160))
    out = tmp_path / "out.parquet"
    slow = ("--batch-size", "1", "--time-limit", "3s", "--require-complete")
    first = _run(job, out, "--max-tokens", "8", *slow)
    assert first.returncode == 4, first.stderr  # incomplete, and it had to complete
    _stamped(first.stderr)
    stats = json.loads((tmp_path / "out.parquet.stats.json").read_text())
    assert stats["time_limited"] and not stats["complete"] and 0 < stats["rows"] < 160
    left = f"{stats['rows']} of 160 rows, {160 - stats['rows']} pending"
    assert f"incomplete: {left} (stopped at --time-limit; rerun to go on)" in first.stderr
    status = _cli("status", str(out))
    assert status.returncode == 4 and "ended at its --time-limit at 20" in status.stdout, status.stdout
    second = _run(job, out, "--max-tokens", "8")  # the width is no part of the results: wide now
    assert second.returncode == 0, second.stderr
    assert [r["id"] for r in read(out)] == [r["id"] for r in _rows(160)]  # each once, in job order
    assert f"160 rows: 160 ok, 0 failed ({stats['rows']} resumed)" in second.stderr
    done = _cli("status", str(out), "--json")
    after = json.loads(done.stdout)
    assert done.returncode == 0 and after["state"] == "complete" and after["rows"] == after["ok"] == 160
    assert after["last_run"]["state"] == "complete" and after["last_run"]["done"] == 160 - stats["rows"]
    text = _cli("status", str(out))
    assert text.stdout.startswith(f"{out}: complete · 160 rows: 160 ok, 0 failed\n  last run: started ")


def test_the_error_file_and_exit_codes_that_tell_tonight_from_last_month(tmp_path):
    rows = [{"id": "a", "prompt": "Hello."}, {"id": "gone", "image": "missing.png", "prompt": "What?"},
            {"id": "b", "prompt": "Bye."}]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    flags = ("--model", LM, "--max-tokens", "4", "--fail-on", "new")  # the picture is missing: no VLM needed
    first = _cli("run", str(job), "-o", str(out), *flags)
    assert first.returncode == 1, first.stderr  # failed tonight
    errors = tmp_path / "out.parquet.errors.jsonl"
    lines = [json.loads(line) for line in errors.read_text().splitlines()]
    failed = [r for r in read(out) if r["status"] == "error"]
    assert [(e["id"], e["stage"], e["error"], e["attempts"], e["transient"]) for e in lines] == [
        (r["id"], r["error_stage"], r["error"], r["attempts"], r["transient"]) for r in failed
    ]
    assert [e["id"] for e in lines] == ["gone"] and lines[0]["this_run"] and lines[0]["stage"] == "fetch"
    assert f"failed rows listed in {errors}" in first.stderr
    # The failure is permanent: a rerun does not retry it, and under --fail-on new it is not tonight's.
    second = _cli("run", str(job), "-o", str(out), *flags)
    assert second.returncode == 0, second.stderr
    assert "1 failed earlier, not retried; 0 failed in this run" in second.stderr
    assert not json.loads(errors.read_text())["this_run"]
    assert _cli("run", str(job), "-o", str(out), *flags[:-2]).returncode == 1  # --fail-on any: still 1
    assert _cli("run", str(job), "-o", str(out), *flags[:-1], "none").returncode == 0
    write_jsonl(job, [*rows, {"id": "new", "image": "also-missing.png", "prompt": "What?"}])
    third = _cli("run", str(job), "-o", str(out), *flags)
    assert third.returncode == 1, third.stderr  # a row failed tonight
    assert {e["id"]: e["this_run"] for e in map(json.loads, errors.read_text().splitlines())} == {
        "gone": False,
        "new": True,
    }
    # Named elsewhere; and once nothing fails, no error file is left to lie.
    named = tmp_path / "failed-rows.jsonl"
    ok_job = write_jsonl(tmp_path / "ok.jsonl", [{"id": "x", "prompt": "Hi."}])
    assert (
        _cli(
            "run", str(job), "-o", str(tmp_path / "o2.parquet"), *flags, "--errors-file", str(named)
        ).returncode
        == 1
    )
    assert [json.loads(x)["id"] for x in named.read_text().splitlines()] == ["gone", "new"]
    (tmp_path / "ok.parquet.errors.jsonl").write_text("stale\n")
    assert _cli("run", str(ok_job), "-o", str(tmp_path / "ok.parquet"), *flags).returncode == 0
    assert not (tmp_path / "ok.parquet.errors.jsonl").exists()


def test_every_stderr_line_is_stamped_without_a_terminal_error_exits_too(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", _rows(3))
    out = tmp_path / "out.parquet"
    ok = _run(job, out, "--max-tokens", "4")
    assert ok.returncode == 0 and "INFO wrote " in ok.stderr
    _stamped(ok.stderr)
    again = _run(job, out, "--max-tokens", "4", "-q")
    assert "INFO up to date: " in again.stderr
    _stamped(again.stderr)
    write_jsonl(job, [{**r, "prompt": r["prompt"] + " Changed."} for r in _rows(3)])
    refused = _run(job, out, "--max-tokens", "4")
    assert refused.returncode == 2 and "ERROR error: " in refused.stderr and "changed" in refused.stderr
    _stamped(refused.stderr)
    bad = _cli("run", str(job), "-o", str(out), "--model", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "ERROR error: model " in bad.stderr
    _stamped(bad.stderr)
    missing = _cli("run", str(tmp_path / "none.jsonl"), "-o", str(out), "--model", LM)
    assert missing.returncode == 2
    _stamped(missing.stderr)
    with open(tmp_path / "out.parquet.lock", "w") as held:  # another run holds the output
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        locked = _run(job, out, "--max-tokens", "4", "--changed", "redo")
    assert locked.returncode == 2 and "being written by another batchgen run" in locked.stderr
    _stamped(locked.stderr)

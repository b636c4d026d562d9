"""Outputs as a folder of Parquet shards (`-o DIR/`), and jobs and outputs on object storage:
a local S3-compatible server (moto) on 127.0.0.1 stands in for S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import MODELS, run_cli, write_jsonl

QUICK = ("--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"), "--temperature", "0",
         "--max-tokens", "2", "-q")  # fmt: skip


def _preset(tmp_path, **settings):
    path = tmp_path / "small-shards.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
    return str(path)


def test_an_output_folder_holds_shards_of_bounded_size_that_readers_take(tmp_path, scripted):
    import datasets
    import pandas as pd

    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(50)])
    out = tmp_path / "out"
    config = _preset(tmp_path, shard_rows=20, flush_rows=8)
    code, output = run_cli("run", str(job), "-o", f"{out}/", "--config", config, *QUICK)
    assert code == 0, output
    shards = sorted(out.glob("part-*.parquet"))
    sizes = [pq.ParquetFile(s).metadata.num_rows for s in shards]
    assert sum(sizes) == 50 and len(shards) == 3 and max(sizes) <= 24  # three parts of 8 make a shard
    assert not (out / "_partial").exists() and (out / "_stats.json").exists()
    frame = pd.read_parquet(out)
    assert sorted(frame["id"]) == sorted(f"r{i}" for i in range(50)) and set(frame["status"]) == {"ok"}
    loaded = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train")
    assert loaded.num_rows == 50

    code, again = run_cli("run", str(job), "-o", f"{out}/", "--config", config, *QUICK)  # nothing to do
    assert code == 0 and sorted(out.glob("part-*.parquet")) == shards
    code, summary = run_cli("inspect", str(out))
    assert code == 0 and "50 rows, 50 ok" in summary
    merged = tmp_path / "all.parquet"
    code, output = run_cli("merge", str(out), "-o", str(merged), "--job", str(job))
    assert code == 0 and [r["id"] for r in pq.read_table(merged).to_pylist()] == [f"r{i}" for i in range(50)]


_SLOW = """
import sys, time
import batchgen.execution.runner as runner
record = runner.record_row
def slow(*args):
    record(*args)
    time.sleep(0.05)
runner.record_row = slow
from batchgen.cli.commands import main
main(prog_name="batchgen")
"""


def _kill_when(proc, ready, limit=90.0):
    deadline = time.monotonic() + limit
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)  # also closes its pipe


@pytest.mark.slow  # a subprocess killed mid-run
def test_a_killed_run_into_shards_resumes_with_every_row_once(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(60)])
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _SLOW, "run", str(job), "-o", f"{out}/", "--config",
           _preset(tmp_path, shard_rows=12, flush_rows=4), "--batch-size", "1", *QUICK]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _kill_when(proc, lambda: len(list(out.glob("part-*.parquet"))) >= 2)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(60))  # every row, once


@pytest.mark.slow  # moto S3 and a kill -9
def test_a_job_on_s3_runs_into_shards_on_s3_and_resumes_after_kill_9(tmp_path, s3):
    fs, env = s3
    for k in range(2):
        rows = [{"id": f"s{k}-{i}", "prompt": f"Item {i}.", "n": i} for i in range(30)]
        with fs.open(f"bucket/jobs/{k:05d}.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    cmd = [sys.executable, "-c", _SLOW, "run", "s3://bucket/jobs/", "-o", "s3://bucket/out/", "--config",
           _preset(tmp_path, shard_rows=8, flush_rows=4), "--batch-size", "1", *QUICK]  # fmt: skip
    environ = {**os.environ, **env}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environ)

    def shards():
        fs.invalidate_cache()
        return (
            [p for p in fs.ls("bucket/out", detail=False) if p.endswith(".parquet")]  # a shard per job file
            if fs.exists("bucket/out")
            else []
        )

    _kill_when(proc, lambda: len(shards()) >= 1)  # 00000.parquet is written, 00001's rows in parts
    first = len(shards())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 0, done.stderr
    assert "resuming" not in done.stderr or "rows done" in done.stderr
    fs.invalidate_cache()
    tables = [pq.read_table(fs.open(p, "rb")) for p in sorted(shards())]
    table = pa.concat_tables(tables)
    assert len(tables) > first and [p.rsplit("/", 1)[-1] for p in sorted(shards())] == [
        "00000.parquet",
        "00001.parquet",
    ]
    assert sorted(table.column("id").to_pylist()) == sorted(f"s{k}-{i}" for k in range(2) for i in range(30))
    assert set(table.column("status").to_pylist()) == {"ok"} and "n" in table.column_names
    stats = json.loads(fs.cat("bucket/out/_stats.json"))
    assert stats["rows"] == 60 and stats["resumed"] > 0
    assert not fs.exists("bucket/out/_partial")


def test_unreachable_or_unknown_uris_exit_2(tmp_path, s3):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    code, output = run_cli("run", str(job), "-o", "nosuchscheme://x/out.parquet", *QUICK)
    assert code == 2 and "-o nosuchscheme://x/out.parquet" in output
    code, output = run_cli("run", "s3://bucket/missing/", "-o", str(tmp_path / "o.parquet"), *QUICK)
    assert code == 2 and "s3://bucket/missing/" in output


def test_a_folder_of_job_files_gives_an_output_shard_each_named_as_it_is(tmp_path, scripted):
    """img2dataset and NeMo Curator users join by shard: `00000.parquet` in, `00000.parquet` out."""
    import pandas as pd

    jobs = tmp_path / "jobs"
    (jobs / "more").mkdir(parents=True)
    files = {"00000.parquet": 5, "00001.parquet": 3, "more/00002.parquet": 4, "more/00003.parquet": 0}
    for name, n in files.items():
        rows = {
            "key": [f"{name[-13:-8]}{i:04d}" for i in range(n)],
            "caption": [f"Row {i}." for i in range(n)],
        }
        pq.write_table(
            pa.table(rows, pa.schema([("key", pa.string()), ("caption", pa.string())])), jobs / name
        )
    out = tmp_path / "out"
    flags = ("--id-column", "key", "--prompt-column", "caption", "--config", _preset(tmp_path, flush_rows=2))
    code, output = run_cli("run", str(jobs), "-o", f"{out}/", *flags, "--limit", "7", *QUICK)
    assert code == 0, output
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet")) == [
        "00000.parquet",
        "00001.parquet",
        "more/00003.parquet",  # a file without rows: an empty shard
    ]
    assert pq.read_table(out / "00001.parquet").column("key").to_pylist() == [
        "000010000",
        "000010001",
    ]  # 2 of 3

    # A kill after a shard was written and before its parts went: the parts are still there.
    shard = pq.read_table(out / "00000.parquet")
    (out / "_partial").mkdir()
    settings = json.loads(shard.schema.metadata[b"batchgen.settings"])
    (out / "_partial" / "manifest.json").write_text(json.dumps({"settings": settings, "overwrite": False}))
    pq.write_table(
        shard.replace_schema_metadata({b"batchgen.input_file": b"0"}),
        out / "_partial" / "part-000001.parquet",
    )
    code, output = run_cli("run", str(jobs), "-o", f"{out}/", *flags, *QUICK)
    assert code == 0 and "12 rows: 12 ok, 0 failed (7 resumed)" in output, output
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.parquet"))
    assert names == sorted(files) and not (out / "_partial").exists()
    for name, n in files.items():
        keys = pq.read_table(out / name).column("key").to_pylist()
        assert keys == [f"{name[-13:-8]}{i:04d}" for i in range(n)], (
            name
        )  # each row once, in its file's order
    assert len(pd.read_parquet(out)) == 12
    code, summary = run_cli("inspect", str(out))
    assert code == 0 and "12 rows, 12 ok" in summary
    code, again = run_cli("run", str(jobs), "-o", f"{out}/", *flags, *QUICK)
    assert code == 0 and "(12 resumed)" in again

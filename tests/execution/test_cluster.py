"""Scale-out: Ray Data and --shard give the local engine's output, row for row."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import MODELS, read, run_cli, write_jsonl

pytestmark = pytest.mark.slow  # Ray: a cluster started per test

ray = pytest.importorskip("ray")

TIMING = ("fetch_ms", "decode_ms", "frames_ms", "generate_ms")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for these tests: dashboard off, its files in a private folder."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="bg-ray-")
    ray.init(
        num_cpus=4, include_dashboard=False, _temp_dir=temp, logging_level="WARNING", log_to_driver=False
    )
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def hard_timeout():
    """Ray can hang on starved resources: no test may outlive this."""

    def expired(signum, frame):
        raise TimeoutError("Ray test timed out")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _rows(workdir):
    return [
        {"id": "t1", "prompt": "Hello there."},
        {"id": "i1", "image": "media/red_circle.png", "prompt": "What shape is this?"},
        {"id": "bad", "max_tokens": "ten", "prompt": "x"},
        {"id": "i2", "image": "media/blue_square.webp", "prompt": "What colour is the shape?"},
        {"id": "missing", "image": "media/nope.png", "prompt": "?"},
        {"id": "t2", "messages": [{"role": "user", "content": "Count to three."}]},
    ]


def _run(job, out, *flags):
    models = ("--model", str(MODELS / "shapes-vlm"), "--text-model", str(MODELS / "tiny-lm"))
    return run_cli(
        "run", str(job), "-o", str(out), *models, "--temperature", "0", "--max-tokens", "8", "-q", *flags
    )


def _content(path):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read(path)]


def test_ray_engine_gives_the_local_output_and_a_rerun_writes_nothing(workdir):
    job = write_jsonl(workdir / "jobs.jsonl", _rows(workdir))
    code, _ = _run(job, workdir / "local.parquet")
    assert code == 1
    code, output = _run(job, workdir / "ray.parquet", "--engine", "ray", "--workers", "2")
    assert code == 1, output
    assert _content(workdir / "ray.parquet") == _content(workdir / "local.parquet")
    before = (workdir / "ray.parquet").read_bytes()
    code, output = _run(job, workdir / "ray.parquet", "--engine", "ray", "--workers", "2")
    assert code == 1 and "(6 resumed)" in output
    assert (workdir / "ray.parquet").read_bytes() == before


def test_shards_partition_the_ids_and_merge_rebuilds_the_output(workdir):
    rows = [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(12)]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    assert _run(job, workdir / "all.parquet")[0] == 0
    parts = []
    for i in range(3):
        parts.append(workdir / f"shard{i}.parquet")
        assert _run(job, parts[-1], "--shard", f"{i}/3")[0] == 0
    ids = [[r["id"] for r in read(p)] for p in parts]
    assert sorted(sum(ids, [])) == sorted(r["id"] for r in rows)  # a partition: all, once
    assert all(ids)  # every shard got rows
    code, output = run_cli(
        "merge", *map(str, parts), "-o", str(workdir / "merged.parquet"), "--job", str(job)
    )
    assert code == 0, output
    assert _content(workdir / "merged.parquet") == _content(workdir / "all.parquet")
    again = (str(parts[0]), str(parts[0]), str(parts[1]))
    code, output = run_cli("merge", *again, "-o", str(workdir / "m2.parquet"), "--job", str(job))
    assert code == 1 and "missing" in output and "duplicated" in output


def test_a_ray_run_reports_the_local_runs_media_and_cache_figures(workdir):
    rows = [
        {"id": f"{image}-{q}", "image": f"media/{image}", "system": "Answer briefly.", "prompt": question}
        for image in ("red_circle.png", "blue_square.webp")
        for q, question in enumerate(["What shape is this?", "What colour is it?", "Describe it."])
    ] + [{"id": "text", "prompt": "Hello."}]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    figures = {}
    for engine in ("local", "ray"):
        out = workdir / f"{engine}.parquet"
        code, output = _run(job, out, "--engine", engine, "--workers", "1")
        assert code == 0, output
        stats = json.loads(out.with_name(out.name + ".stats.json").read_text())
        figures[engine] = (stats["media"], stats["cache"])
    media, cache = figures["local"]
    assert media["image_decodes"] == 2 and media["image_decode_reuses"] == 4 and cache["prefix_hits"] > 0
    assert figures["ray"] == figures["local"]


def test_ray_actors_never_decode_one_picture_twice(workdir):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(5)
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(workdir / f"p{i}.png")
    rows = [{"id": f"p{i}-q{q}", "image": f"p{i}.png", "prompt": f"Question {q}?"}
            for q in range(3) for i in range(12)]  # fmt: skip
    job = write_jsonl(workdir / "jobs.jsonl", rows)  # prompt-major: a picture's rows 12 rows apart
    out = workdir / "ray.parquet"
    code, output = _run(job, out, "--engine", "ray", "--workers", "2", "--window", "4")
    assert code == 0, output
    stats = json.loads(out.with_name(out.name + ".stats.json").read_text())
    assert stats["media"]["image_decodes"] == 12 and stats["media"]["image_decode_reuses"] == 24
    assert [r["id"] for r in read(out)] == [r["id"] for r in rows]


def test_sigterm_during_a_ray_run_exits_143_and_the_rerun_completes(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Tell a long story number {i}.", "max_tokens": 150} for i in range(40)]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out), "-q", "--engine", "ray",
           "--model", str(MODELS / "tiny-lm"), "--temperature", "0", "--window", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = out.with_name(out.name + ".partial")
    deadline = time.monotonic() + 120
    while not list(partial.glob("part-*.parquet")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no rows were committed"
        time.sleep(0.1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err, err
    assert time.monotonic() - t0 < 30 and not out.exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    # committed batch by batch (a block a batch), not when an actor's quarter of the job is done
    resumed = int(re.search(r"\((\d+) resumed\)", done.stderr).group(1))
    assert 0 < resumed < len(rows), done.stderr
    assert [r["id"] for r in read(out)] == [r["id"] for r in rows]


def test_ray_driver_reads_no_rows_and_parquet_types_survive(workdir, monkeypatch):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    import batchgen.input.read

    n = 150
    table = pa.table({
        "id": [f"r{i}" for i in range(n)],
        "prompt": [f"Item {i} of the list." for i in range(n)],
        "blob": [bytes([i % 256, 0, 255]) for i in range(n)],
        "when": [datetime.datetime(2026, 1, 1) + datetime.timedelta(hours=i) for i in range(n)],
        "tags": [[f"t{i}", "x"] for i in range(n)],
    })  # fmt: skip
    job = workdir / "jobs.parquet"
    pq.write_table(table, job, row_group_size=40)  # four row groups: items start at each
    keep = ("--max-tokens", "3", "--keep-columns", "blob")  # binary columns are dropped unless kept
    assert _run(job, workdir / "local.parquet", *keep)[0] == 0

    def no_reading(*args, **kwargs):
        raise AssertionError("the driver read rows")

    monkeypatch.setattr(batchgen.input.read.JobIndex, "read", no_reading)  # the pending rows' reader
    out = workdir / "ray.parquet"
    code, output = _run(job, out, *keep, "--engine", "ray", "--workers", "2", "--limit", "55")
    assert code == 0, output
    code, output = _run(job, out, *keep, "--engine", "ray", "--workers", "2")
    assert code == 0 and "(55 resumed)" in output, output
    assert _content(out) == _content(workdir / "local.parquet")
    assert pq.read_schema(out).field("when").type == table.schema.field("when").type
    assert [r["blob"] for r in read(out)] == table.column("blob").to_pylist()


def test_a_failed_ray_run_is_its_own_exit_code_not_a_settings_error(workdir):
    """A model whose config reads but whose weights do not: the driver inspects it (no error
    before any work), the actors fail to load it; the run says so and exits 6, not 2."""
    import shutil

    broken = workdir / "broken-lm"
    shutil.copytree(MODELS / "tiny-lm", broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    job = write_jsonl(workdir / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Row {i}."} for i in range(4)])
    code, output = run_cli("run", str(job), "-o", str(workdir / "out.parquet"), "--model", str(broken),
                           "--engine", "ray", "--workers", "1", "-q")  # fmt: skip
    assert code == 6 and "the Ray run failed" in output and "cannot load it" in output, output

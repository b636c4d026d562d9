"""Hostile input, round five: an error file that never replaces a file batchgen did not write,
`status` that reads what runs leave bounded and typed, no stale caption written as done,
thinking rows as the template writes them, and the smaller round-five cases."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
from conftest import batch, write_jsonl

import batchgen

# -- 1. the error file is written only where batchgen owns the name ----------------------------


def _job(tmp_path, failing: bool = True):
    rows = [{"id": "a", "prompt": "Hello."}, {"id": "b", "prompt": "Bye.", "script": "fail" if failing else ""}]
    return write_jsonl(tmp_path / "job.jsonl", rows)


def _snapshot(path):
    """What a path is now: its bytes, a link's target, or its kind (None: nothing there)."""
    if not os.path.lexists(path):
        return None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "link:" + os.readlink(path)
    if stat.S_ISREG(info.st_mode):
        return path.read_bytes()
    return "dir" if stat.S_ISDIR(info.st_mode) else "other"


@pytest.mark.parametrize("failing", [True, False])
def test_errors_file_naming_the_results_is_refused_before_any_work(tmp_path, scripted, failing):
    job, out = _job(tmp_path, failing), tmp_path / "out.parquet"
    code, said = batch(job, out, "--errors-file", str(out))
    assert code == 2 and f"--errors-file {out}: is -o of this run" in said
    assert not out.exists()  # nothing was run
    assert batch(job, out)[0] in (0, 1)
    before = out.read_bytes()
    code, said = batch(job, out, "--errors-file", str(out))
    assert code == 2 and out.read_bytes() == before


@pytest.mark.parametrize("name, what", [
    ("out.parquet.stats.json", "the stats file"), ("out.parquet.heartbeat.json", "the heartbeat"),
    ("out.parquet.lock", "the lock"), ("out.parquet.partial/x.jsonl", "the parts folder"),
])  # fmt: skip
def test_errors_file_naming_one_of_the_runs_own_files_is_refused(tmp_path, scripted, name, what):
    code, said = batch(_job(tmp_path), tmp_path / "out.parquet", "--errors-file", str(tmp_path / name))
    assert code == 2 and f"is {what} of this run" in said


def test_errors_file_naming_the_job_says_errors_file(tmp_path, scripted):
    job = _job(tmp_path)
    code, said = batch(job, tmp_path / "out.parquet", "--errors-file", str(job))
    assert code == 2 and f"--errors-file {job}: is the job file itself" in said and "-o " not in said


def test_an_existing_file_batchgen_did_not_write_is_never_replaced_or_removed(tmp_path, scripted):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    other = tmp_path / "other.parquet"
    assert batch(_job(tmp_path, failing=False), other)[0] == 0  # another output: its files are not ours
    for target in (notes, other, tmp_path / "other.parquet.stats.json"):
        before = target.read_bytes()
        for failing in (True, False):
            code, said = batch(_job(tmp_path, failing), tmp_path / "out.parquet", "--errors-file", str(target))
            assert code == 2 and "not the error file this output's last run wrote" in said, said
            assert target.read_bytes() == before
    with pytest.raises(batchgen.ConfigError, match="not the error file"):  # the Python API too
        batchgen.run(batchgen.build_config(_job(tmp_path), tmp_path / "out.parquet", errors_file=notes))
    assert notes.read_text() == "my notes\n"


def test_batchgens_own_error_file_is_refreshed_and_removed_but_not_once_edited(tmp_path, scripted):
    out, named = tmp_path / "out.parquet", tmp_path / "failed.jsonl"
    assert batch(_job(tmp_path), out, "--errors-file", str(named), "--max-attempts", "3")[0] == 1
    assert [json.loads(line)["id"] for line in named.read_text().splitlines()] == ["b"]
    assert batch(_job(tmp_path), out, "--errors-file", str(named), "--max-attempts", "3")[0] == 1  # ours
    assert [json.loads(line)["id"] for line in named.read_text().splitlines()] == ["b"]
    assert batch(_job(tmp_path, failing=False), out, "--errors-file", str(named), "--changed", "redo")[0] == 0
    assert not named.exists()  # none failed: batchgen's own file goes, so a stale one never stays
    assert batch(_job(tmp_path), out, "--errors-file", str(named), "--changed", "redo")[0] == 1
    named.write_text(named.read_text() + "a note of mine\n")  # edited since: no longer batchgen's
    code, said = batch(_job(tmp_path, failing=False), out, "--errors-file", str(named), "--changed", "redo")
    assert code == 2 and named.read_text().endswith("a note of mine\n")


def test_fuzzed_errors_file_targets_never_change_a_file_batchgen_did_not_write(tmp_path, scripted):
    rng = random.Random(47)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "media" / "a.png")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "notes.jsonl").write_text('{"id": "b", "stage": "generate"}\n')
    names = ["media/a.png", "dir", "fifo", "link", "dangling", "notes.jsonl", "job.jsonl", "out.parquet",
             "out.parquet.stats.json", "out.parquet.heartbeat.json", "out.parquet.lock", "dir/../notes.jsonl",
             "out.parquet.partial", "./out.parquet", "media/../media/a.png"]  # fmt: skip
    for trial in range(24):
        failing = rng.random() < 0.6
        job = _job(tmp_path, failing)
        if trial % 3 == 0:
            assert batch(job, tmp_path / "out.parquet", "--changed", "redo")[0] in (0, 1)
        target = tmp_path / rng.choice(names)
        theirs = {n: _snapshot(tmp_path / n) for n in names if not n.startswith("out.parquet")}
        code, said = batch(job, tmp_path / "out.parquet", "--errors-file", str(target), "--changed", "redo")
        assert code == 2, (target, said)  # every one of these is someone's file, or the run's own
        assert {n: _snapshot(tmp_path / n) for n in theirs} == theirs, target

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
    rows = [
        {"id": "a", "prompt": "Hello."},
        {"id": "b", "prompt": "Bye.", "script": "fail" if failing else ""},
    ]
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
            code, said = batch(
                _job(tmp_path, failing), tmp_path / "out.parquet", "--errors-file", str(target)
            )
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


# -- 2. status reads what runs leave bounded, as regular files, typed ----------------------------


def _status(out, *extra):
    """`batchgen status OUT` in this process, under a watchdog: a read that hangs fails the test
    instead of stalling the suite; the Python heap's peak is measured around it."""
    import threading
    import tracemalloc

    from conftest import run_cli

    said: list = []
    tracemalloc.start()
    worker = threading.Thread(target=lambda: said.append(run_cli("status", str(out), *extra)), daemon=True)
    worker.start()
    worker.join(20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not worker.is_alive(), "status hung"
    assert peak < 100 << 20, f"status took {peak >> 20} MiB"
    return said[0]


def _done(tmp_path, scripted):
    out = tmp_path / "out.parquet"
    assert batch(_job(tmp_path), out)[0] == 1
    return out


_BEAT = {"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00+0000", "todo": 121, "done_before": 0}


@pytest.mark.parametrize("kind", ["zero", "fifo", "folder", "huge", "nan", "types", "list", "deep"])
@pytest.mark.parametrize("which", ["heartbeat", "lock", "stats"])
def test_status_leaves_out_a_forged_file_without_hanging_crashing_or_printing_controls(
    tmp_path, scripted, which, kind
):
    out = _done(tmp_path, scripted)
    ending = {"heartbeat": "heartbeat.json", "lock": "lock", "stats": "stats.json"}[which]
    path = tmp_path / f"out.parquet.{ending}"
    path.unlink(missing_ok=True)
    if kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        path.write_bytes(b" " * (8 << 20) + b"{}")
    else:
        value = {
            "nan": {**_BEAT, "rows": float("nan"), "rows_per_s": float("nan"), "done": 1e308},
            "types": {**_BEAT, "pid": "1", "todo": [1], "done": {"a": 1}, "rows": "5", "ok": None,
                      "errors_by_stage": ["x"], "state": 7, "message": {"\x1b[31m": 1}},
            "list": [1, 2, 3],
            "deep": {**_BEAT, "state": "running\n2026-01-01 00:00:00 ERROR forged\x1b[2J",
                     "host": "h" * 9999},
        }[kind]  # fmt: skip
        path.write_text(json.dumps(value, allow_nan=True) if kind != "deep" else json.dumps(value))
    for extra in ((), ("--json",)):
        code, text = _status(out, *extra)
        assert code in (0, 1, 2, 4, 5) and "Traceback" not in text, text
        assert "\x1b" not in text and "NaN" not in text and "nan " not in text, text
        assert not any(line.startswith("20") and "ERROR forged" in line for line in text.splitlines())
        if extra and code != 2:
            json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    if which != "lock" and code != 2:  # the results are still there: said, with the file left out
        assert "not a file batchgen wrote (damaged, forged, not a regular file): left out" in text, text


def test_status_names_each_file_it_left_out(tmp_path, scripted):
    out = _done(tmp_path, scripted)
    (tmp_path / "out.parquet.heartbeat.json").unlink()
    (tmp_path / "out.parquet.heartbeat.json").symlink_to("/dev/zero")
    code, text = _status(out)
    assert code == 1 and text.startswith(f"{out}: complete · 2 rows: 1 ok, 1 failed"), text
    assert f"note: {out}.heartbeat.json: not a file batchgen wrote" in text
    (tmp_path / "out.parquet.stats.json").write_text('{"rows": NaN}')
    code, text = _status(out)
    assert code == 2 and "no batchgen run has written here" in text, text


def test_status_escapes_shard_names_and_messages_from_files(tmp_path, scripted):
    folder = tmp_path / "jobs"
    folder.mkdir()
    odd = "a\n2026-01-01 00:00:00 ERROR forged\x1b[31m"
    write_jsonl(folder / f"{odd}.jsonl", [{"id": "x", "prompt": "Hi."}])
    out = tmp_path / "out"
    from conftest import run_cli

    assert run_cli("run", str(folder), "-o", f"{out}/", "--model", "scripted")[0] == 0
    beat = json.loads((out / "_heartbeat.json").read_text())
    ended = {**beat, "state": "failed", "message": "boom\n\x1b[2Jgone"}
    (out / "_heartbeat.json").write_text(json.dumps(ended))
    code, text = _status(out)
    assert "\x1b" not in text and len([line for line in text.splitlines() if "forged" in line]) == 1, text
    assert "boom\\n\\x1b[2Jgone" in text and "shard a\\n2026-01-01" in text, text


# -- 6. a left-over lock is not a run ----------------------------------------------------------------


def test_a_left_over_lock_naming_a_live_process_is_not_a_run(tmp_path, scripted):
    out = _done(tmp_path, scripted)
    lock = tmp_path / "out.parquet.lock"
    lock.write_text("1")  # pid 1 lives, but holds no lock on this file
    code, text = _status(out)
    assert code == 1 and "complete" in text.splitlines()[0], text
    beat = json.loads((tmp_path / "out.parquet.heartbeat.json").read_text())
    killed = {**beat, "pid": 1, "state": "running", "done_before": 2, "todo": 0, "done": 0, "failed": 0}
    (tmp_path / "out.parquet.heartbeat.json").write_text(json.dumps(killed))
    code, text = _status(out)  # a later run killed at its start, its pid since reused by a live process
    assert code == 4 and "ended without a word" in text, text
    assert "2 of 2 rows, 0 pending; 1 ok, 1 failed" in text, text
    with batchgen.output.run_files.OutputLock(out):  # a run that holds the lock is running
        code, text = _status(out)
    assert code == 5 and text.startswith(f"{out}: running"), text


def test_status_after_kill_9_counts_the_committed_rows(tmp_path):
    out = tmp_path / "out.parquet"
    beat = {**_BEAT, "pid": 2**31 - 1, "host": os.uname().nodename, "todo": 121, "done": 57, "failed": 3}
    (tmp_path / "out.parquet.heartbeat.json").write_text(json.dumps(beat))
    (tmp_path / "out.parquet.lock").write_text(str(2**31 - 1))
    code, text = _status(out)
    assert code == 4, text
    assert text.splitlines()[0] == f"{out}: incomplete · 57 of 121 rows, 64 pending; 54 ok, 3 failed", text


# -- 3. no stale caption written as done ----------------------------------------------------------


def _shapes():
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import train_shapes_captioner

    return train_shapes_captioner


def _caption(folder, out, *extra):
    from conftest import MODELS, run_cli

    return run_cli("caption", str(folder), "-o", str(out), "--model", str(MODELS / "shapes-vlm"),
                   "-p", "What shape is this?", "--temperature", "0", "--max-tokens", "6", "-q", *extra)  # fmt: skip


def test_a_picture_replaced_since_the_run_gets_no_stale_caption_and_a_redo_refreshes_it(tmp_path):
    from conftest import run_cli

    shapes, rng = _shapes(), random.Random(5)
    folder, out = tmp_path / "ds", tmp_path / "captions.parquet"
    folder.mkdir()
    shapes.draw("circle", "red", rng).save(folder / "a.png")
    shapes.draw("square", "blue", rng).save(folder / "b.png")
    assert _caption(folder, out)[0] == 0
    assert run_cli("export", str(out), "--format", "txt")[0] == 0
    assert (folder / "a.txt").read_text() == "circle\n"
    shapes.draw("star", "yellow", rng).save(folder / "a.png")  # a re-crop, before any rerun
    code, said = run_cli("export", str(out), "--format", "txt")
    assert code == 1 and "changed since the run" in said and "a.png" in said, said
    assert (folder / "a.txt").read_text() == "circle\n"  # left as it was, not rewritten as if current
    for fmt in ("imagefolder", "wide"):
        extra = ("--to", str(tmp_path / "hf")) if fmt == "imagefolder" else ("-o", str(tmp_path / "w.parquet"))
        code, said = run_cli("export", str(out), "--format", fmt, *extra)
        assert code == 1 and "changed since the run (rerun with --changed redo" in said, said
    assert "a.png" not in (tmp_path / "hf" / "metadata.jsonl").read_text()
    code, said = run_cli("export", str(out), "--format", "txt", "--changed", "keep")
    assert code == 0, said  # asked for: written anyway
    assert _caption(folder, out, "--changed", "redo")[0] == 0
    code, said = run_cli("export", str(out), "--format", "txt")  # the README's step: batchgen's file refreshed
    assert code == 0 and "wrote 1 (1 up to date)" in said, said
    assert (folder / "a.txt").read_text() == "star\n" and (folder / "b.txt").read_text() == "square\n"
    shapes.draw("circle", "red", rng).save(folder / "a.png")  # `caption --write-captions txt` alike
    code, said = _caption(folder, out, "--changed", "redo", "--write-captions", "txt")
    assert code == 0 and (folder / "a.txt").read_text() == "circle\n", said
    (folder / "b.txt").write_text("my own words\n")  # edited by hand: no longer batchgen's
    shapes.draw("star", "yellow", rng).save(folder / "b.png")
    code, said = _caption(folder, out, "--changed", "redo", "--write-captions", "txt")
    assert code == 1 and "1 already there, not batchgen's, kept" in said, said
    assert (folder / "b.txt").read_text() == "my own words\n"


def test_a_forged_caption_manifest_makes_no_file_batchgens(tmp_path):
    from conftest import run_cli

    shapes = _shapes()
    folder, out = tmp_path / "ds", tmp_path / "captions.parquet"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(1)).save(folder / "a.png")
    assert _caption(folder, out)[0] == 0
    (folder / "a.txt").write_text("mine\n")
    for forged in ("/dev/zero", "[1, 2]", '{"a.txt": 7}', '{"a.txt": "' + "0" * 64 + '"}'):
        manifest = folder / ".batchgen-captions.json"
        manifest.unlink(missing_ok=True)
        if forged.startswith("/"):
            manifest.symlink_to(forged)
        else:
            manifest.write_text(forged)
        code, said = run_cli("export", str(out), "--format", "txt")
        assert code == 1 and (folder / "a.txt").read_text() == "mine\n", (forged, said)

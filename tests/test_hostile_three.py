"""Hostile input, round three: constraints that cannot hang or crash a run, byte caps before
anything is read whole, remote jobs that stay remote, a gallery that runs no script, job URIs
under the URL policy, and resume that survives kills, edits and replaced shards."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import MEDIA, MODELS, batch, read, run_cli, write_jsonl
from mediaserver import MediaServer

from batchgen.core.constraints import check, constraint_of, satisfied
from batchgen.input.read import scan
from batchgen.input.source import Source, resolve

NESTED = "(?:" * 2000 + "a" + ")" * 2000


def _one_line(rows):
    for r in rows:
        if r["status"] == "error":
            assert "\n" not in r["error"] and len(r["error"]) < 400, r["error"]


# -- constraints ------------------------------------------------------------------------------


def _constraint_cases():
    """(row, stage or None for ok-or-generate, fragment of the error)."""
    return [
        ({"guided_regex": "(.+)+!", "max_tokens": 6}, None, None),
        ({"guided_regex": "(a|aa)+$", "max_tokens": 6}, None, None),
        ({"json_schema": {"type": "object", "required": ["s"],
                          "properties": {"s": {"type": "string", "pattern": "^(a+)+[[x]]$"}}},
          "max_tokens": 6}, None, None),
        ({"guided_regex": NESTED}, "read", "guided_regex: cannot be compiled"),
        ({"guided_regex": "(" * 300 + ")" * 300}, "read", "cannot be compiled"),
        ({"json_schema": {"$ref": "#"}}, "read", "json_schema: cannot be compiled (no output can begin it"),
        ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "read",
         "no output can begin it"),
        ({"json_schema": {"type": "array", "minItems": 1e9}}, "read", "minItems 1e+09 is over 100,000"),
        ({"json_schema": {"type": "string", "minLength": 10**12}}, "read", "minLength"),
        ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "read", "over 100,000 characters"),
        ({"guided_choice": [str(i) for i in range(12_000)]}, "read", "over 10,000 choices"),
        ({"guided_regex": "a" * 200_000}, "read", "over 100,000 characters"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": 5}}}}, "read", "cannot be compiled"),
        ({"guided_regex": "[z-a]"}, "read", "cannot be compiled"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}}, "read",
         "response_format: cannot be compiled"),
        ({"guided_choice": ["yes", "no"], "max_tokens": 8}, None, None),
    ]  # fmt: skip


def _fuzz_regex(r: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", "[ab]", "\\d", "x*", "(?:a|b)", "\\w+", "[^a]"]
    if depth > 3 or r.random() < 0.3:
        return r.choice(atoms)
    kind = r.choice(["cat", "alt", "group", "quant", "nestq"])
    if kind == "cat":
        return _fuzz_regex(r, depth + 1) + _fuzz_regex(r, depth + 1)
    if kind == "alt":
        return f"{_fuzz_regex(r, depth + 1)}|{_fuzz_regex(r, depth + 1)}"
    if kind == "group":
        return f"({_fuzz_regex(r, depth + 1)})"
    quant = r.choice(["+", "*", "?", "{1,3}", "{2,}", "{0,50}"])
    if kind == "quant":
        return f"(?:{_fuzz_regex(r, depth + 1)}){quant}"
    return f"(({_fuzz_regex(r, depth + 1)}){quant}){r.choice(['+', '*'])}"  # nested quantifiers


def _fuzz_schema(r: random.Random, depth: int = 0):
    choice = r.randrange(9)
    if depth > 3 or choice == 0:
        return {"type": r.choice(["string", "integer", "number", "boolean", "null"])}
    if choice == 1:
        return {"type": "string", "pattern": _fuzz_regex(r), "maxLength": r.randrange(1, 40)}
    if choice == 2:
        return {"type": "array", "items": _fuzz_schema(r, depth + 1), "minItems": r.choice([0, 1, 3, 10**7]),
                "maxItems": r.choice([2, 5, None]) or 5}  # fmt: skip
    if choice == 3:
        return (
            {"$ref": "#"}
            if r.random() < 0.5
            else {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}
        )
    if choice == 4:
        return {"enum": [r.choice(["a", 1, None, True, [1]]) for _ in range(r.randrange(1, 4))]}
    if choice == 5:
        return {"anyOf": [_fuzz_schema(r, depth + 1) for _ in range(2)]}
    if choice == 6:
        return {"type": r.choice(["strin", 7, ["string", "x"]])}  # invalid on purpose
    props = {f"k{i}": _fuzz_schema(r, depth + 1) for i in range(r.randrange(1, 4))}
    return {"type": "object", "properties": props, "required": sorted(props)[:1],
            "additionalProperties": r.random() < 0.5}  # fmt: skip


def _fuzz_constraints(seed: int, n: int) -> list[dict]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append({"guided_regex": _fuzz_regex(r)})
        else:
            out.append({"json_schema": _fuzz_schema(r)})
    return out


def test_constraint_checks_are_bounded_on_fuzzed_regexes_schemas_and_texts():
    """Every fuzzed constraint is either refused at read with a one-line reason or judged on
    hostile texts (backtracking bait, deep JSON, huge strings) without an exception."""
    r = random.Random(23)
    texts = ["", "a" * 5000, "a" * 3000 + "!", "[" * 5000, '{"k0": "' + "a" * 4000 + '"}', "\ud800",
             "{" + '"a": {' * 3000, "ab" * 2000, json.dumps({"k0": [1] * 1000})]  # fmt: skip
    compiled = refused = 0
    for spec in _fuzz_constraints(seed=7, n=240):
        problems: list = []
        c = constraint_of(spec, problems)
        if c is None:
            refused += 1
            assert problems and all("\n" not in msg and len(msg) < 400 for _, msg in problems), problems
            continue
        compiled += 1
        assert check(c) is None
        for text in [*texts, _fuzz_regex(r)]:
            parsed, why = satisfied(c, text)
            assert why is None or isinstance(why, str)
            if parsed is not None:
                json.loads(parsed)
    assert compiled > 100 and refused > 20  # both halves of the corpus exercised


def test_hostile_constraints_never_stop_a_run_and_fuzzed_ones_finish(tmp_path):
    cases = _constraint_cases()
    fuzzed = _fuzz_constraints(seed=11, n=30)
    rows = [{"id": f"c{i}", "prompt": "Answer.", **row} for i, (row, _, _) in enumerate(cases)]
    rows += [{"id": f"f{i}", "prompt": "Answer.", "max_tokens": 6, **spec} for i, spec in enumerate(fuzzed)]
    rows.append({"id": "plain", "prompt": "Hello."})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = batch(job, out)
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert len(got) == len(rows) and got["plain"]["status"] == "ok"
    for i, (_, stage, fragment) in enumerate(cases):
        row = got[f"c{i}"]
        if stage is None:
            assert row["status"] == "ok" or row["error_stage"] == "generate", (i, row["error"])
            continue
        assert (row["status"], row["error_stage"]) == ("error", stage), (i, row["error"])
        assert fragment in row["error"], (i, row["error"])
    for i in range(len(fuzzed)):
        assert got[f"f{i}"]["status"] == "ok" or got[f"f{i}"]["error_stage"] in ("read", "generate")
    _one_line(got.values())
    code, output = batch(job, out)  # the rerun resumes: nothing stops or crashes it either
    assert code == 1 and f"{len(rows)} rows: " in output, output


@pytest.mark.slow  # a subprocess stopped by SIGTERM
def test_a_stop_request_ends_a_run_of_backtracking_bait_within_seconds(tmp_path):
    rows = [
        {"id": f"r{i}", "prompt": f"Item {i}.", "guided_regex": "(.+)+!", "max_tokens": 48}
        for i in range(400)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out),
           "--model", str(MODELS / "tiny-lm"), "--temperature", "0", "--batch-size", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = tmp_path / "out.parquet.partial"
    deadline = time.monotonic() + 120
    while not list(partial.glob("part-*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # until rows are on disk (a batch a part): generation and checks are running
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not stop within 30 s of SIGTERM")
    assert proc.returncode == 143, output
    assert "stopped by SIGTERM" in output and list(partial.glob("part-*.parquet"))


# -- bytes ------------------------------------------------------------------------------------


def _sparse_tar(path, members: dict[str, int | bytes]) -> None:
    """A tar whose large members are holes: the header says their size, the disk holds nothing."""
    with open(path, "wb") as f:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = body if isinstance(body, int) else len(body)
            f.write(info.tobuf())
            if isinstance(body, int):
                f.seek(body, 1)
                f.seek(-body % 512, 1)
            else:
                f.write(body + b"\0" * (-len(body) % 512))
        f.write(b"\0" * 1024)
        f.truncate()


class _Counted:
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def __init__(self, f):
        self.f = f

    def read(self, n=-1):
        data = self.f.read(n)
        _Counted.read_bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class _Counting(Source):
    """The job's files as they are, read through `_Counted`."""

    def open(self, shard: int):
        return _Counted(super().open(shard))


def test_tar_members_and_binary_cells_are_capped_before_they_are_read(tmp_path, scripted):
    png = (MEDIA / "red_circle.png").read_bytes()
    tar = tmp_path / "shard.tar"
    _sparse_tar(tar, {"00000.png": png, "00000.txt": b"a red circle",
                      "00001.png": 400 * 2**20, "00001.txt": b"a bomb",
                      "00002.mp4": 600 * 2**20,
                      "00003.png": 300_000,  # over a 200,000-byte image cap
                      "00004.png": png})  # fmt: skip
    assert tar.stat().st_blocks * 512 < 2**20  # a small file on disk
    # The scan reads headers and text members only.
    source = resolve(tar)
    counting = _Counting(source.given, source.format, source.shards, source.base)
    _Counted.read_bytes = 0
    index = scan(counting)
    assert index.ids == ["00000", "00001", "00002", "00003", "00004"]
    assert 0 < _Counted.read_bytes < 64 * 1024
    preset = tmp_path / "caps.yaml"
    preset.write_text("media: {image_bytes: 200000}\n")
    out = tmp_path / "out.parquet"
    code, output = batch(tar, out, "--prompt-template", "What is it?", "--config", str(preset))
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert got["00000"]["status"] == "ok" and got["00004"]["status"] == "ok"
    assert (
        got["00001"]["error"] == "member 00001.png of 419,430,400 bytes is over the image cap (200,000 bytes)"
    )
    assert "00002.mp4 of 629,145,600 bytes is over the video cap (524,288,000 bytes)" in got["00002"]["error"]
    assert "00003.png of 300,000 bytes is over the image cap" in got["00003"]["error"]
    assert {got[k]["error_stage"] for k in ("00001", "00002", "00003")} == {"read"}
    code, output = batch(tar, out, "--prompt-template", "What is it?", "--config", str(preset))
    assert code == 1 and "(5 resumed)" in output  # the headers' fingerprint is the same on rerun

    table = pa.table({
        "id": ["ok", "big", "also-ok", "nested"],
        "image": [png, b"\0" * 300_000, png, None],
        "images": [None, None, None, [png, b"\1" * 300_000]],
        "prompt": ["What?"] * 4,
    })  # fmt: skip
    one_group = tmp_path / "cells.parquet"
    pq.write_table(table, one_group)  # one row group: the big cell is nulled, its row an error
    each_row = tmp_path / "groups.parquet"
    pq.write_table(table, each_row, row_group_size=1)  # the big cell's chunk is never decoded
    for job in (one_group, each_row):
        out = tmp_path / f"{job.stem}.out.parquet"
        code, output = batch(job, out, "--config", str(preset))
        assert code == 1, output
        got = {r["id"]: r for r in read(out)}
        assert got["ok"]["status"] == got["also-ok"]["status"] == "ok"
        assert got["big"]["error_stage"] == "read"
        assert got["big"]["error"].startswith("column 'image': ")
        assert "over the image cap (200,000 bytes)" in got["big"]["error"]
        assert got["nested"]["error_stage"] == "fetch"  # a list's item: capped when it is resolved
        assert "300,000 bytes is over the image cap (200,000 bytes)" in got["nested"]["error"]


# -- remote jobs, job URIs, the gallery ------------------------------------------------------------


def test_a_remote_job_reads_no_local_path_and_its_gallery_opens_none(tmp_path, s3, monkeypatch):
    fs, _ = s3
    monkeypatch.chdir(tmp_path)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "red_circle.png").write_bytes((MEDIA / "red_circle.png").read_bytes())
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    paths = ["/proc/self/environ", "~/../media/red_circle.png", "/no/such/file.png", "media/red_circle.png",
             str(tmp_path / "media" / "red_circle.png"), "~nosuchuser/a.png"]  # fmt: skip
    rows = [{"id": f"p{i}", "image": p, "prompt": "What?"} for i, p in enumerate(paths)]
    rows.append({"id": "text", "prompt": "Hi."})
    with fs.open("bucket/remote/jobs.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    code, output = batch("s3://bucket/remote/jobs.jsonl", out)
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert got["text"]["status"] == "ok"
    for i in range(len(paths)):
        row = got[f"p{i}"]
        assert row["error_stage"] == "fetch", row
        refused = ": a local path, in a job that may not name this machine's files (give a URL or the bytes)"
        assert row["error"].endswith(refused), row["error"]
        assert "no such file" not in row["error"] and "environ" not in row["error"].split(":", 1)[1]
    page = tmp_path / "gallery.html"
    code, output = run_cli("report", str(out), "-o", str(page))
    assert code == 0 and "a remote job's local paths are not opened" in output
    data = _gallery_data(page)
    assert all(shown == [] for shown in data["thumbs"].values())


def _gallery_data(page) -> dict:
    text = page.read_text()
    start = text.index('<script id="data" type="application/json">') + len(
        '<script id="data" type="application/json">'
    )
    block = text[start : text.index("</script>", start)]
    assert "<" not in block  # nothing in the data can close the script element or open a comment
    return json.loads(block)


def test_the_gallery_escapes_every_value_once_and_keeps_to_the_runs_media_policy(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    outside = workdir.parent / f"{workdir.name}-outside.png"
    outside.write_bytes((MEDIA / "red_circle.png").read_bytes())
    inside = workdir / "inside"
    inside.mkdir()
    os.mkfifo(inside / "fifo.mp4")
    (inside / "ok.png").write_bytes((MEDIA / "red_circle.png").read_bytes())
    rows = [
        {"id": "x", "image": "inside/ok.png", "prompt": '<img src=x onerror="document.title=1">'},
        {"id": "y", "image": str(outside), "prompt": "<!--<script>alert(1)</script>"},
        {"id": "z", "video": "inside/fifo.mp4", "prompt": "</script><b>bold</b>"},
    ]
    job = write_jsonl(workdir / "__DATA__.jsonl", rows)
    code, output = batch(job, workdir / "__DATA__.results.parquet", "--media-root", str(inside))
    assert code == 1, output
    got = {r["id"]: r for r in read(workdir / "__DATA__.results.parquet")}
    assert "outside the media root" in got["y"]["error"] and "not a regular file" in got["z"]["error"]
    page = workdir / "gallery.html"
    code, output = run_cli("report", str(workdir / "__DATA__.results.parquet"), "-o", str(page))
    assert code == 0, output
    text = page.read_text()
    head = text[: text.index('<script id="data"')]
    assert '<h2 style="margin:0">__DATA__.results.parquet</h2>' in head  # the name, as it is
    assert "onerror" not in head and '"question"' not in head  # no row data outside its block
    data = _gallery_data(page)
    asked = [e["question"] for c in data["cards"] for e in c["entries"]]
    assert asked == [r["prompt"] for r in rows]  # shown as text, whole
    assert data["thumbs"]["image:inside/ok.png"] == ["inside/ok.png"]
    assert data["thumbs"][f"image:{outside}"] == [] and data["thumbs"]["video:inside/fifo.mp4"] == []


def test_job_and_output_uris_outside_storage_are_refused_before_any_connection(tmp_path, network):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    with MediaServer(MEDIA) as server:
        port = server.server_port
        cases = [
            ("run", f"http://public.test:{port}/redirect?to=http://127.0.0.1:{port}/internal.jsonl", "-o",
             str(tmp_path / "a.parquet")),
            ("run", f"zip://jobs.jsonl::http://127.0.0.1:{port}/jobs.zip", "-o", str(tmp_path / "b.parquet")),
            ("run", f"simplecache::http://127.0.0.1:{port}/j.jsonl", "-o", str(tmp_path / "c.parquet")),
            ("run", str(job), "-o", f"http://127.0.0.1:{port}/out.parquet"),
            ("run", str(job), "-o", f"zip://out.parquet::https://public.test:{port}/o.zip"),
            ("validate", f"https://public.test:{port}/jobs.jsonl"),
        ]  # fmt: skip
        for args in cases:
            code, output = (
                run_cli(*args, "--model", str(MODELS / "tiny-lm"), "-q")
                if args[0] == "run"
                else run_cli(*args)
            )
            assert code == 2, (args, output)
            assert "is not read as a job or output location" in output or "no such job file" in output, output
        assert server.hits == {} and network.connects == []


def test_file_uris_are_local_paths(tmp_path, monkeypatch, scripted):
    monkeypatch.chdir(tmp_path)
    job = write_jsonl(tmp_path / "my jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    out = tmp_path / "out dir" / "res.parquet"
    code, output = batch(job.as_uri(), out.as_uri())  # file:///…/my%20jobs.jsonl
    assert code == 0, output
    assert read(out)[0]["status"] == "ok" and not (tmp_path / "file:").exists()
    code, output = batch(str(job), "file://elsewhere/x.parquet")
    assert code == 2 and "a file:// URI names a path on this machine" in output


# -- exits cron can read ----------------------------------------------------------------------


def test_bad_settings_files_and_foreign_shard_folders_exit_2_before_any_work(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(tmp_path / "fifo.yaml")
    cases = [
        (("--json-schema", str(deep)), "--json-schema " + str(deep) + ": nested too deep to read"),
        (("--json-schema", "/dev/zero"), "--json-schema /dev/zero: not a regular file"),
        (("--config", "/dev/zero"), "config /dev/zero: not a regular file"),
        (("--config", str(tmp_path / "fifo.yaml")), "not a regular file"),
    ]
    for flags, message in cases:
        code, output = batch(job, tmp_path / "o.parquet", *flags)
        assert code == 2 and message in output and "Traceback" not in output, (flags, output)
    spark = tmp_path / "spark"
    spark.mkdir()
    pq.write_table(pa.table({"x": [1]}), spark / "part-00000-1a2b-c000.snappy.parquet")
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    pq.write_table(pa.table({"id": ["a"], "status": ["ok"]}), lookalike / "part-000001.parquet")
    for folder, name in ((spark, "part-00000-1a2b-c000.snappy.parquet"), (lookalike, "part-000001.parquet")):
        for extra in ((), ("--overwrite",)):
            code, output = batch(job, f"{folder}/", *extra)
            assert code == 2 and f"{name} is not a shard batchgen wrote" in output, output
        assert sorted(p.name for p in folder.iterdir()) == [name]  # nothing written, nothing removed
    assert not (tmp_path / "o.parquet").exists()


def test_bad_environment_values_name_their_variable(tmp_path, monkeypatch):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    monkeypatch.setenv("BATCHGEN_RUN_MAX_TOKENS", "ten")
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(tmp_path / "o.parquet")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "'ten' is not a valid integer" in result.stderr
    assert "from the environment variable BATCHGEN_RUN_MAX_TOKENS" in result.stderr


# -- resume -----------------------------------------------------------------------------------


def test_a_rerun_after_editing_many_rows_names_five_and_counts_the_rest(tmp_path, scripted):
    rows = [{"id": f"r{i}", "prompt": f"Caption {i}."} for i in range(8)]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    assert batch(job, out)[0] == 0
    write_jsonl(job, [{**r, "prompt": r["prompt"] + " Short."} if i < 6 else r for i, r in enumerate(rows)])
    code, output = batch(job, out)
    assert code == 2, output
    assert "6 row(s) changed since their results were written: line 1 (id 'r0')" in output
    assert "line 5 (id 'r4') and 1 more; pass --changed redo to generate them again, --changed keep" in output


def test_a_retried_row_is_held_once_in_a_shard_folder_after_a_kill(workdir, network, scripted):
    """The state a kill -9 leaves when a retried row's new record reached a shard before the
    earlier shard lost its old record: the next run holds each id once and exits 0."""
    import shutil

    with MediaServer(workdir / "media") as server:
        rows = [{"id": "remote", "image": f"{server.url}/img/red_circle.png", "prompt": "What?"},
                {"id": "text", "prompt": "Hi."}]  # fmt: skip
        job = write_jsonl(workdir / "jobs.jsonl", rows)
        preset = workdir / "fast.yaml"
        preset.write_text("media: {retries: 1}\n")
        flags = ("--allow-private-urls", "--config", str(preset))
        out = workdir / "out"
        server.down = True
        assert batch(job, f"{out}/", *flags)[0] == 1
        before = workdir / "before"
        shutil.copytree(out, before)
        server.down = False
        assert batch(job, f"{out}/", *flags)[0] == 0
        shards = sorted(p.name for p in out.glob("part-*.parquet"))
        assert len(shards) == 2
        shutil.copy(before / shards[0], out / shards[0])  # the old record back: killed before it went
        assert pq.read_table(out).num_rows == 3  # the id twice, as a reader sees the folder
        code, output = batch(job, f"{out}/", *flags)
    assert code == 0 and "2 rows: 2 ok, 0 failed" in output, output
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == ["remote", "text"]
    assert {r["id"]: r["attempts"] for r in table.to_pylist()} == {"remote": 2, "text": 1}


def test_a_shard_replaced_during_a_run_is_said_and_its_rows_stay_to_do(tmp_path, monkeypatch, scripted):
    import batchgen.execution.start

    folder = tmp_path / "job"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"id": f"a{i}", "prompt": f"A {i}."} for i in range(3)])
    write_jsonl(folder / "b.jsonl", [{"id": f"b{i}", "prompt": f"B {i}."} for i in range(3)])
    real_scan = batchgen.execution.start.scan

    def scan_then_replace(*args, **kwargs):
        index = real_scan(*args, **kwargs)
        shorter = tmp_path / "b.new"
        write_jsonl(shorter, [{"id": f"b{i}", "prompt": f"B {i}."} for i in range(2)])
        os.replace(shorter, folder / "b.jsonl")  # as a sync job would, mid-run
        return index

    monkeypatch.setattr(batchgen.execution.start, "scan", scan_then_replace)
    out = tmp_path / "out.parquet"
    code, output = batch(folder, out)
    assert code == 2, output
    assert "b.jsonl: changed since the run started" in output and "rerun" in output
    monkeypatch.setattr(batchgen.execution.start, "scan", real_scan)
    code, output = batch(folder, out)
    assert code == 0 and "5 rows: 5 ok, 0 failed" in output, output


# -- models and the URL policy ----------------------------------------------------------------


def test_text_rows_use_mlx_vlm_when_mlx_lm_cannot_load_a_multimodal_checkpoint(
    sensitive_qwen3_vl_moe, tmp_path
):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "t", "prompt": "Hello there."},
                                                 {"id": "u", "prompt": "And again."}])  # fmt: skip
    flags = ("--model", str(sensitive_qwen3_vl_moe), "--temperature", "0", "--max-tokens", "4")
    code, output = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), *flags)
    assert code == 0, output
    assert [r["status"] for r in read(tmp_path / "o.parquet")] == ["ok", "ok"]
    assert output.count("mlx-lm cannot load") == 1 and "text rows use mlx-vlm" in output


@pytest.mark.slow  # a subprocess run
def test_an_allowed_private_target_is_said_and_recorded(tmp_path, monkeypatch):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi."}])
    monkeypatch.setenv("BATCHGEN_RUN_ALLOW_PRIVATE_URLS", "1")
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out),
           "--model", str(MODELS / "tiny-lm"), "--max-tokens", "2"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "warning: private and loopback URLs are allowed" in result.stderr
    assert "warning: private and loopback URLs were allowed" in result.stderr  # the closing line too
    stats = json.loads((tmp_path / "out.parquet.stats.json").read_text())
    assert stats["private_urls_allowed"] is True
    policy = json.loads(pq.read_schema(out).metadata[b"batchgen.media_policy"])
    assert policy["allow_private_urls"] is True


def test_smaller_round_three_cases(workdir, network):
    """A refused hop names the row's own reference; a FIFO is no missing file; inspect
    escapes ids; an OpenAI body with both token limits names both."""
    os.mkfifo(workdir / "pipe.png")
    with MediaServer(workdir / "media") as server:
        port = server.server_port
        hop = f"http://public.test:{port}/redirect?to=http://127.0.0.1:{port}/img/red_circle.png"
        rows = [{"id": "hop", "image": hop, "prompt": "What?"},
                {"id": "pipe", "image": "pipe.png", "prompt": "What?"},
                {"id": "\x1b[31mred\x07", "prompt": "Hi."}]  # fmt: skip
        job = write_jsonl(workdir / "jobs.jsonl", rows)
        out = workdir / "out.parquet"
        code, output = batch(job, out)
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert got["hop"]["error"].startswith(f"http://public.test:{port}/redirect?to=")
    assert "redirected to" in got["hop"]["error"] and "non-public address 127.0.0.1" in got["hop"]["error"]
    assert "pipe.png: not a regular file" in got["pipe"]["error"]
    code, shown = run_cli("inspect", str(out))
    assert code == 0 and "\x1b" not in shown and "\x07" not in shown and "\\x1b[31mred\\x07" in shown
    batch_file = workdir / "batch.jsonl"
    write_jsonl(batch_file, [{"custom_id": "both", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                       "max_completion_tokens": 7}},
                             {"custom_id": "same", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                       "max_completion_tokens": 3}}])  # fmt: skip
    code, output = batch(batch_file, workdir / "b.parquet")
    assert code == 1, output
    got = {r["id"]: r for r in read(workdir / "b.parquet")}
    assert got["same"]["status"] == "ok" and got["both"]["error_stage"] == "read"
    assert "max_completion_tokens" in got["both"]["error"] and "max_tokens" in got["both"]["error"]


def test_a_glob_over_a_symlink_loop_finds_each_job_file_once(tmp_path, scripted):
    (tmp_path / "loop" / "in").mkdir(parents=True)
    write_jsonl(tmp_path / "loop" / "in" / "a.jsonl", [{"id": "a", "prompt": "Hi."}])
    (tmp_path / "loop" / "in" / "up").symlink_to("..")
    (tmp_path / "loop" / "self").symlink_to(".")
    source = resolve(f"{tmp_path}/loop/**/*.jsonl")
    assert [s.name for s in source.shards] == ["in/a.jsonl"]
    code, output = batch(f"{tmp_path}/loop/**/*.jsonl", tmp_path / "o.parquet")
    assert code == 0 and "1 row: 1 ok" in output, output

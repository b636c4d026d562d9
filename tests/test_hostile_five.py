"""Hostile input, round five: an error file that never replaces a file batchgen did not write,
`status` that reads what runs leave bounded and typed, no stale caption written as done,
thinking rows as the template writes them, and the smaller round-five cases."""

from __future__ import annotations

import json
import os
import random
import re
import stat

import pytest
from conftest import MODELS, ROOT, batch, read, run_cli, write_jsonl

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

    sys.path.insert(0, str(ROOT / "scripts"))
    import train_shapes_captioner

    return train_shapes_captioner


def _caption(folder, out, *extra):
    model = ("--model", str(MODELS / "shapes-vlm"), "--temperature", "0", "--max-tokens", "6", "-q")
    return run_cli("caption", str(folder), "-o", str(out), *model, "-p", "What shape is this?", *extra)


def _captioned_pair(tmp_path, seed: int):
    """A red circle (a.png) and a blue square (b.png) captioned by the shapes captioner; the
    drawing module and its random source, to draw again."""
    shapes, rng = _shapes(), random.Random(seed)
    folder, out = tmp_path / "ds", tmp_path / "captions.parquet"
    folder.mkdir()
    shapes.draw("circle", "red", rng).save(folder / "a.png")
    shapes.draw("square", "blue", rng).save(folder / "b.png")
    assert _caption(folder, out)[0] == 0
    return shapes, rng, folder, out


def test_a_picture_replaced_since_the_run_gets_no_stale_caption_and_a_redo_refreshes_it(tmp_path):
    shapes, rng, folder, out = _captioned_pair(tmp_path, 5)
    assert run_cli("export", str(out), "--format", "txt")[0] == 0
    assert (folder / "a.txt").read_text() == "circle\n"
    shapes.draw("star", "yellow", rng).save(folder / "a.png")  # a re-crop, before any rerun
    code, said = run_cli("export", str(out), "--format", "txt")
    assert code == 1 and "changed since the run" in said and "a.png" in said, said
    assert (folder / "a.txt").read_text() == "circle\n"  # left as it was, not rewritten as if current
    for fmt in ("imagefolder", "wide"):
        extra = (
            ("--to", str(tmp_path / "hf")) if fmt == "imagefolder" else ("-o", str(tmp_path / "w.parquet"))
        )
        code, said = run_cli("export", str(out), "--format", fmt, *extra)
        assert code == 1 and "changed since the run (rerun with --changed redo" in said, said
    assert "a.png" not in (tmp_path / "hf" / "metadata.jsonl").read_text()
    code, said = run_cli("export", str(out), "--format", "txt", "--changed", "keep")
    assert code == 0, said  # asked for: written anyway
    assert _caption(folder, out, "--changed", "redo")[0] == 0
    code, said = run_cli(
        "export", str(out), "--format", "txt"
    )  # the README's step: batchgen's file refreshed
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


# -- 4. thinking rows as the template writes them ------------------------------------------------------


@pytest.fixture(scope="module")
def thinkers(tmp_path_factory):
    """A Qwen3-style checkpoint (`<think>`, an enable_thinking template, `<tool_call>` JSON) and one
    with Gemma 4's channel markers, both "sensitive": their output follows the prompt."""
    from batchgen.tools.tiny.builder import make_tiny_model

    root = tmp_path_factory.mktemp("thinkers")
    return {
        kind: make_tiny_model(root / kind, kind, sensitive=True) for kind in ("thinking-lm", "channel-lm")
    }


def _think_run(tmp_path, model, rows, *flags):
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / f"{model.name}.parquet"
    code, said = run_cli("run", str(job), "-o", str(out), "--model", str(model), "--temperature", "0",
                         "-q", "--overwrite", *flags)  # fmt: skip
    assert code in (0, 1), said
    return {r["id"]: r for r in read(out)}


@pytest.mark.parametrize("kind", ["thinking-lm", "channel-lm"])
def test_thinking_unset_renders_as_mlx_lm_generate_renders_it(tmp_path, thinkers, kind):
    import mlx_lm

    model = thinkers[kind]
    rows = [{"id": f"r{k}", "prompt": f"Think about {k} things.", "max_tokens": 12, "logprobs": True}
            for k in range(3)]  # fmt: skip
    got = _think_run(tmp_path, model, rows)
    lm, tokenizer = mlx_lm.load(str(model))
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
        )
        tokens = [r.token for r in mlx_lm.stream_generate(lm, tokenizer, ids, max_tokens=12)]
        assert [r["id"] for r in got[row["id"]]["logprobs"]] == tokens, row["id"]
        assert got[row["id"]]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "lane",
    [(), ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "20")],
    ids=["batched", "one-row"],
)
def test_a_budgeted_answer_gets_max_tokens_after_its_end_marker_however_early_it_closed(
    tmp_path, thinkers, lane
):
    model = thinkers["thinking-lm"]
    end = 8  # `</think>`'s id in the tiny vocabulary, biased so that rows close early, late or never
    rows = [{"id": f"r{k}", "prompt": f"Think about {k} red things.", "max_tokens": 24,
             "reasoning_budget": 16, "logprobs": True, "logit_bias": {str(end): 2.0 * (k % 4)}}
            for k in range(8)]  # fmt: skip
    got = _think_run(tmp_path, model, rows, "--thinking", "on", *lane)
    closed_early = 0
    for row in rows:
        ours = got[row["id"]]
        ids = [r["id"] for r in ours["logprobs"]]
        assert end in ids, row["id"]  # the budget closes every block
        after = len(ids) - ids.index(end) - 1
        assert after <= 24, (row["id"], after)
        assert after == 24 or ours["finish_reason"] == "stop", (row["id"], after, ours["finish_reason"])
        assert ours["reasoning_tokens"] <= 16 and ours["completion_tokens"] == len(ids)
        closed_early += ours["reasoning_tokens"] < 16
    assert closed_early >= 2  # rows that closed before the budget: they once got the budget's rest


def test_a_huge_reasoning_budget_is_the_rows_error_naming_the_bound(tmp_path, thinkers):
    rows = [{"id": "huge", "prompt": "Think.", "max_tokens": 12, "reasoning_budget": 10**9},
            {"id": "fine", "prompt": "Think.", "max_tokens": 12, "reasoning_budget": 32768}]  # fmt: skip
    got = _think_run(tmp_path, thinkers["thinking-lm"], rows, "--thinking", "on")
    assert got["huge"]["status"] == "error" and "32,768" in got["huge"]["error"], got["huge"]["error"]
    assert got["fine"]["status"] == "ok"


def _server_split(tokenizer, text: str, opened: bool, tools):
    """mlx-lm's server on a completion's text: its state machine, its collection of reasoning,
    content and tool texts (server.py's loop, the whole text as one chunk), its formatter."""
    from mlx_lm.generate import TextStateMachine, make_text_state_machine
    from mlx_lm.server import ToolCallFormatter

    state = make_text_state_machine(tokenizer).make_state("reasoning" if opened else "normal")
    state, segments = TextStateMachine.split(state, text)
    state, flushed, current = TextStateMachine.flush(state)
    segments.append((current, flushed))
    reasoning, content, tool_text, calls, previous = "", "", "", [], "reasoning" if opened else "normal"
    for part, chunk in segments:
        if part == "reasoning":
            reasoning += chunk
        elif part == "tool":
            tool_text += chunk
        elif part == "normal":
            if previous == "tool":
                calls.append(tool_text)
                tool_text = ""
            content += chunk
        previous = part
    if previous == "tool" and tool_text:
        calls.append(tool_text)
    formatted = ToolCallFormatter(tokenizer.tool_parser, tools, False)(calls)
    return reasoning, content, [(c["function"]["name"], c["function"]["arguments"]) for c in formatted]


TOOLS = ({"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}},)
GOOD = '<tool_call>\n{"name": "get", "arguments": {"x": 1}}\n</tool_call>'
BAD = '<tool_call>\n{"name": \n</tool_call>'
STRING_ARGUMENTS = '<tool_call>\n{"name": "get", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
SPLITS = {
    "call after the block": ("plan it\n</think>\n\nI will call. " + GOOD, True),
    "a call ends the reasoning": ("let me see " + GOOD + " done", True),
    "a good call, then one that does not parse": ("</think>\n\n" + GOOD + BAD, True),
    "arguments given as a JSON string": ("</think>" + STRING_ARGUMENTS, True),
    "whitespace around the reasoning": ("\n  deep thought \n</think>\n\nthe answer", True),
    "the model opens the block": ("<think> a thought </think> an answer " + GOOD, False),
}  # fmt: skip


@pytest.mark.parametrize("name", SPLITS)
def test_reasoning_answer_and_calls_are_split_as_mlx_lms_server_splits_them(thinkers, name):
    import mlx_lm

    from batchgen.core.params import GenParams
    from batchgen.core.records import Generation
    from batchgen.generate.chat.reasoning import split_generation
    from batchgen.generate.chat.tool_calls import with_tool_calls
    from batchgen.generate.chat.traits import Traits

    text, opened = SPLITS[name]
    _, tokenizer = mlx_lm.load(str(thinkers["thinking-lm"]))
    traits = Traits.of(tokenizer)
    reasoning, content, calls = _server_split(tokenizer, text, opened, [t["function"] for t in TOOLS])
    p = GenParams(tools=TOOLS)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    split = split_generation(
        Generation(text=text, finish_reason="stop", prompt_tokens=0, completion_tokens=len(tokens)),
        tokens,
        traits.markers,
        opened,
    )
    gen = with_tool_calls(split, p, traits.tool_format)
    assert (gen.reasoning or "") == reasoning, name
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in gen.tool_calls or []] == calls, name
    assert calls or not gen.tool_calls
    if "does not parse" in name:  # the server drops the broken call's text; batchgen keeps it, as written
        assert gen.text == BAD and content.strip() == ""
    else:
        assert gen.text == content.strip(), name
    assert gen.finish_reason == ("tool_calls" if calls else "stop")


# -- 5. the GGUF converter checks a file's header before MLX reads it ---------------------------------


def _valid_gguf(path, drop: str = ""):
    """A small llama GGUF file as MLX writes one (float32 tensors), every key the converter reads."""
    import mlx.core as mx

    numbers = {"llama.embedding_length": 64, "llama.block_count": 1, "llama.feed_forward_length": 128,
               "llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
               "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
               "llama.context_length": 256, "llama.vocab_size": 3, "tokenizer.ggml.bos_token_id": 0,
               "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 2,
               "tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.add_bos_token": 0}  # fmt: skip
    meta = {k: mx.array(v) for k, v in numbers.items()}
    meta |= {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b", "ab"],
             "tokenizer.ggml.token_type": mx.array([1, 1, 1]), "tokenizer.ggml.merges": ["a b"],
             "tokenizer.chat_template": "{{ messages }}"}  # fmt: skip
    meta.pop(drop, None)
    mx.save_gguf(
        str(path), {"token_embd.weight": mx.zeros((3, 64)), "output_norm.weight": mx.ones((64,))}, meta
    )
    return path


def _header(*parts: bytes) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<I", 3) + b"".join(parts)


def _hostile_ggufs(tmp_path):
    import struct

    q = lambda n: struct.pack("<Q", n)  # noqa: E731
    i = lambda n: struct.pack("<I", n)  # noqa: E731
    valid = _valid_gguf(tmp_path / "valid.gguf").read_bytes()
    return {
        "a string of length 2**62": _header(q(0), q(1), q(2**62), b"key"),
        "2**31 dimensions": _header(q(1), q(0), q(1), b"t", i(2**31), q(4), i(0), q(0)),
        "a dimension of 2**40": _header(q(1), q(0), q(1), b"t", i(1), q(2**40), i(0), q(0)),
        "a tensor past the end": _header(q(1), q(0), q(1), b"t", i(2), q(4096), q(4096), i(0), q(0)),
        "2**60 tensors": _header(q(2**60), q(0)),
        "an array of 2**50 strings": _header(q(0), q(1), q(1), b"k", i(9), i(8), q(2**50)),
        "an unknown value type": _header(q(0), q(1), q(1), b"k", i(99)),
        "an unknown tensor type": _header(q(1), q(0), q(1), b"t", i(1), q(32), i(77), q(0)),
        "not GGUF at all": b"\x00" * 64,
        "version 1": b"GGUF" + i(1) + valid[8:],
        "cut short": valid[: len(valid) - 200],
        "empty": b"",
    }


def test_a_handmade_gguf_file_is_one_clear_error_never_a_crash(tmp_path):
    import subprocess
    import sys

    from batchgen.tools.tiny.gguf import check_gguf

    assert check_gguf(_valid_gguf(tmp_path / "ok.gguf"))["general.architecture"] == "llama"
    cases = {name: data for name, data in _hostile_ggufs(tmp_path).items()}
    for drop in ("llama.attention.head_count", "tokenizer.ggml.merges", "general.architecture"):
        cases[f"a llama file without {drop}"] = _valid_gguf(tmp_path / "part.gguf", drop).read_bytes()
    script = ROOT / "scripts" / "make_real_model.py"
    for name, data in cases.items():
        path = tmp_path / "hostile.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError):
            check_gguf(path)
        done = subprocess.run([sys.executable, str(script), "--gguf", str(path), str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, (name, done.returncode, done.stderr[-400:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), (name, done.stderr[-400:])
    assert not (tmp_path / "out").exists()


def test_make_real_model_help_is_help(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_real_model.py"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "--gguf" in done.stdout and not (tmp_path / "--help").exists()


# -- 7. a folder linked into the dataset stays where it was linked -----------------------------------


@pytest.mark.parametrize("how", ["caption", "run"])
def test_imagefolder_without_to_writes_beside_the_pictures_never_above_a_linked_folder(tmp_path, how):
    shapes, rng = _shapes(), random.Random(7)
    (tmp_path / "ds").mkdir()
    (tmp_path / "elsewhere").mkdir()
    shapes.draw("circle", "red", rng).save(tmp_path / "ds" / "a.png")
    shapes.draw("square", "blue", rng).save(tmp_path / "elsewhere" / "b.png")
    (tmp_path / "ds" / "sub").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    out = tmp_path / "caps.parquet"
    if how == "caption":
        assert _caption(tmp_path / "ds", out)[0] == 0
    else:
        rows = [{"id": n, "image": n, "prompt": "What shape is this?"} for n in ("a.png", "sub/b.png")]
        job = write_jsonl(tmp_path / "ds" / "job.jsonl", rows)
        model = ("--model", str(MODELS / "shapes-vlm"), "--temperature", "0", "--max-tokens", "6", "-q")
        assert run_cli("run", str(job), "-o", str(out), *model)[0] == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    code, said = run_cli("export", str(out), "--format", "imagefolder")
    assert code == 0 and f"to {tmp_path / 'ds' / 'metadata.jsonl'}" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing above the pictures' folder
    assert not (tmp_path / "elsewhere" / "metadata.jsonl").exists()
    lines = [json.loads(line) for line in (tmp_path / "ds" / "metadata.jsonl").read_text().splitlines()]
    assert lines == [{"file_name": "a.png", "text": "circle"}, {"file_name": "sub/b.png", "text": "square"}]


# -- 8. the README's cron line mails on a bad night, and only then ------------------------------------


def _cron_line() -> str:
    """The command of the README's crontab line (after its five time fields)."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```cron\n") + len("```cron\n") :]
    return block[: block.index("\n```")].split(None, 5)[5]


@pytest.mark.slow  # two runs in subprocesses, as cron starts them
def test_the_readme_cron_line_prints_on_a_bad_night_and_only_then(tmp_path):
    import subprocess
    import sys

    line = _cron_line()
    assert line.startswith(
        "cd /data && batchgen run jobs.jsonl -o out.parquet --config qwen2.5-vl-captioning"
    )
    models = f"--model {MODELS / 'tiny-vlm'} --text-model {MODELS / 'tiny-lm'} --temperature 0 --max-tokens 4"
    line = line.replace("cd /data", f"cd {tmp_path}").replace("--config qwen2.5-vl-captioning", models)
    line = line.replace("batchgen run", f"{sys.executable} -m batchgen run")

    def night(rows):
        write_jsonl(tmp_path / "jobs.jsonl", rows)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
        return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300, env=env)

    good = [{"id": "a", "prompt": "Hello."}]
    mailed = night(good)
    assert mailed.returncode == 0 and mailed.stdout == mailed.stderr == "", mailed  # cron mails nothing
    bad = [*good, {"id": "gone", "image": "missing.png", "prompt": "What?"}]
    mailed = night(bad)
    assert "ERROR 2 rows: 1 ok, 1 failed" in mailed.stdout and "missing.png" not in mailed.stderr, mailed
    mailed = night(bad)  # the same old failure, not retried: no mail under --fail-on new
    assert mailed.returncode == 0 and mailed.stdout == "", mailed
    log = (tmp_path / "batchgen.log").read_text().splitlines()
    closing = [entry.split(" ", 3)[2] for entry in log if re.search(r" \d+ rows?: \d+ ok, ", entry)]
    assert closing == ["INFO", "ERROR", "INFO"], log


def test_a_night_with_new_failures_logs_its_closing_line_at_warning_or_error(tmp_path, scripted):
    rows = _job(tmp_path)  # one row fails
    code, said = batch(rows, tmp_path / "out.parquet", "--fail-on", "none")
    assert code == 0 and any(" WARNING 2 rows: 1 ok, 1 failed" in line for line in said.splitlines()), said
    code, said = batch(rows, tmp_path / "out2.parquet")
    assert code == 1 and any(" ERROR 2 rows: 1 ok, 1 failed" in line for line in said.splitlines()), said


# -- 9, 10. the smaller round-five cases ---------------------------------------------------------------


def test_a_fifo_job_file_is_named_as_one(tmp_path):
    os.mkfifo(tmp_path / "job.jsonl")
    for command in (
        ("validate", str(tmp_path / "job.jsonl")),
        ("run", str(tmp_path / "job.jsonl"), "-o", "x"),
    ):
        code, said = run_cli(*command)
        assert code == 2 and "not a regular file (a FIFO, a device or a socket)" in said, said


@pytest.mark.parametrize("flags, said", [
    (("--time-limit", "999999999999h"), "must be under 1,000,000,000 seconds"),
    (("--time-limit", "0s"), "must be more than 0 seconds"),
    (("--redo-repetition", "inf"), "a repetition penalty above 1 and at most 3"),
    (("--redo-repetition", "1e9"), "a repetition penalty above 1 and at most 3"),
    (("--redo-repetition", "nan"), "a repetition penalty above 1 and at most 3"),
    (("--redo-repetition", "0.5"), "a repetition penalty above 1 and at most 3"),
])  # fmt: skip
def test_settings_out_of_bounds_say_their_bound(tmp_path, scripted, flags, said):
    code, output = batch(_job(tmp_path), tmp_path / "out.parquet", *flags)
    assert code == 2 and said in output and not (tmp_path / "out.parquet").exists(), output


def test_plan_without_calibrate_says_how_to_get_a_time(tmp_path):
    job = write_jsonl(tmp_path / "job.jsonl", [{"id": "a", "prompt": "Hello."}])
    code, text = run_cli(
        "plan", str(job), "-o", str(tmp_path / "out.parquet"), "--model", str(MODELS / "tiny-lm")
    )
    assert code == 0 and "--calibrate N generates N rows and projects the run's wall time" in text, text


def test_make_tiny_model_help_describes_the_thinking_kinds():
    code, text = run_cli("make-tiny-model", "--help")
    described = " ".join(text.split("Options:")[0].split())  # as one line, however click wraps it
    assert code == 0 and "thinking-lm: lm with Qwen3's <think> markers" in described, described
    assert "channel-lm: lm with Gemma 4's <|channel>thought" in described, described


def test_inspect_names_a_broken_stats_file(tmp_path, scripted):
    out = _done(tmp_path, scripted)
    (tmp_path / "out.parquet.stats.json").write_text("{not json")
    code, text = run_cli("inspect", str(out))
    assert code == 0 and "out.parquet.stats.json: not a stats file batchgen wrote" in text, text


def test_the_gallery_says_which_pictures_changed_since_the_run(tmp_path):
    shapes, rng, folder, out = _captioned_pair(tmp_path, 9)
    page = tmp_path / "gallery.html"
    code, said = run_cli("report", str(out), "-o", str(page))
    assert code == 0 and "changed since the run" not in said
    shapes.draw("star", "yellow", rng).save(folder / "a.png")
    code, said = run_cli("report", str(out), "-o", str(page))
    assert code == 0 and "1 picture(s) changed since the run: ds/a.png" in said, said
    html = page.read_text()
    start = html.index('<script id="data" type="application/json">')
    data = json.loads(html[html.index(">", start) + 1 : html.index("</script>", start)])
    changed = {c["id"]: c.get("changed") for c in data["cards"]}
    assert changed == {"ds/a.png": ["ds/a.png"], "ds/b.png": None}, changed


# -- 11. caption's exit code fails a picture once, so `caption && export` goes on -----------------------


def test_caption_reruns_exit_0_for_an_old_broken_picture_so_caption_and_export_chain(tmp_path):
    shapes = _shapes()
    folder, out = tmp_path / "ds", tmp_path / "captions.parquet"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(3)).save(folder / "a.png")
    (folder / "broken.png").write_bytes(b"not a png")
    code, said = _caption(folder, out)
    assert code == 1 and "1 failed" in said, said  # the night it fails: exit 1
    code, said = _caption(folder, out)
    assert code == 0 and "1 failed earlier, not retried; 0 failed in this run" in said, said
    assert run_cli("export", str(out), "--format", "txt")[0] == 0  # the chain goes on
    assert _caption(folder, out, "--fail-on", "any")[0] == 1  # asked for: every run fails for it


def test_the_openai_batch_paragraph_names_only_fields_that_are_refused(tmp_path):
    """Every field the README says makes a line an error is refused; none it says is read is."""
    from batchgen.input.openai_batch import from_batch_request

    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("**OpenAI Batch files**") : text.index("endpoint's line says so")]
    read, refused = paragraph.split("A field batchgen cannot honour")
    values = {"logprobs": True, "top_logprobs": 2, "tools": [], "tool_choice": "auto", "n": 2,
              "response_format": {"type": "json_object"}, "reasoning_budget": 8, "audio": {"voice": "x"},
              "modalities": ["audio"], "prediction": {"type": "content"}, "functions": [],
              "function_call": "auto", "stream": True}  # fmt: skip
    taken = set(re.findall(r"`([a-z_]+)`", read))
    for field in re.findall(r"`([a-z_]+)`", refused):
        if field in values and field not in taken:  # response_format: refused of another type only
            _, problems = from_batch_request(
                {"custom_id": "x", "body": {"messages": [], field: values[field]}}
            )
            assert problems and problems[0][0] == f"body.{field}", field
    for field in re.findall(r"`([a-z_]+)`", read):
        if field in values:
            _, problems = from_batch_request(
                {"custom_id": "x", "body": {"messages": [], field: values[field]}}
            )
            assert not problems, (field, problems)


def _fuzzed(path, rng: random.Random, good: bytes | None) -> str:
    """Something random where a run's file goes: what batchgen wrote, nothing, a link to a device,
    a FIFO, a folder, random bytes, or JSON of random types and sizes."""
    kind = rng.choice(["good", "absent", "zero", "urandom", "fifo", "folder", "bytes", "json", "json"])
    if os.path.lexists(path):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    if kind == "good" and good is not None:
        path.write_bytes(good)
    elif kind in ("zero", "urandom"):
        path.symlink_to(f"/dev/{kind}")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "bytes":
        path.write_bytes(rng.randbytes(rng.choice([0, 7, 4096, 70_000, 2_000_000])))
    elif kind == "json":
        pick = [None, True, -1, 2**70, 1e308, -0.5, "x" * rng.choice([1, 5000]), "\x1b[2J\n", [1], {"a": 1}]
        keys = [
            "pid",
            "host",
            "started",
            "todo",
            "done_before",
            "done",
            "failed",
            "rows_per_s",
            "eta_s",
            "state",
            "message",
            "rows",
            "ok",
            "pending",
            "job_rows",
            "errors_by_stage",
            "complete",
        ]
        value = {k: rng.choice(pick) for k in rng.sample(keys, rng.randrange(len(keys)))}
        path.write_text(json.dumps(value))
    return kind


def test_fuzzed_status_inputs_never_hang_crash_balloon_or_print_controls(tmp_path, scripted):
    out = _done(tmp_path, scripted)
    names = ("out.parquet.heartbeat.json", "out.parquet.lock", "out.parquet.stats.json")
    good = {n: (tmp_path / n).read_bytes() if (tmp_path / n).exists() else None for n in names}
    rng = random.Random(2047)
    for trial in range(30):
        kinds = {n: _fuzzed(tmp_path / n, rng, good[n]) for n in names}
        for extra in ((), ("--json",)):
            code, text = _status(out, *extra)  # bounded in time and memory, or it fails here
            assert code in (0, 1, 2, 4, 5) and "Traceback" not in text, (trial, kinds, text[-500:])
            assert "\x1b" not in text, (trial, kinds)
            if extra and code != 2:
                json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in --json"))

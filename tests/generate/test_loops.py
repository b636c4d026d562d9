"""The loop stop: a row whose last tokens repeat a short cycle ends there, with its text up to
the first repeat; every other row, and every row of a run without it, is the engines' own."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import MODELS, SAMPLE, read, run_cli, write_jsonl

from batchgen.core.params import GenParams
from batchgen.generate.chat.traits import Traits
from batchgen.generate.decode.sampling import Loops
from batchgen.generate.lanes.one_row import collect

SPAN, MOST = 64, 32


def first_loop(ids: list[int]) -> tuple[int, int] | None:
    """Brute force: (tokens generated when the last SPAN tokens first repeat a cycle of at
    most MOST tokens, tokens to keep: up to the end of the cycle's first occurrence)."""
    for n in range(SPAN, len(ids) + 1):
        tail = ids[n - SPAN : n]
        for p in range(1, MOST + 1):
            if all(tail[i] == tail[i + p] for i in range(SPAN - p)):
                start = n - SPAN
                while start > 0 and ids[start - 1] == ids[start - 1 + p]:
                    start -= 1
                return n, start + p
    return None


def _ids(row):
    return (
        [t["id"] for t in json.loads(row["logprobs"])]
        if isinstance(row["logprobs"], str)
        else [t["id"] for t in row["logprobs"]]
    )


@pytest.mark.slow  # long looping rows against an unstopped run (3 s)
def test_looping_rows_end_at_their_loop_and_the_others_are_unchanged(tmp_path):
    import mlx_lm

    rows = [
        {"id": f"r{i}", "prompt": f"Tell me about item {i} and more.", "max_tokens": 200} for i in range(6)
    ]
    rows.append({"id": "short", "prompt": "Hi", "max_tokens": 20})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    base = ["--model", str(MODELS / "tiny-lm"), "--temperature", "0", "--logprobs", "-q"]
    code, text = run_cli("run", str(job), "-o", str(tmp_path / "plain.parquet"), *base)
    assert code == 0, text
    code, text = run_cli(
        "run", str(job), "-o", str(tmp_path / "stopped.parquet"), *base, "--stop-repetition", "64"
    )
    assert code == 0, text
    plain = {r["id"]: r for r in read(tmp_path / "plain.parquet")}
    stopped = {r["id"]: r for r in read(tmp_path / "stopped.parquet")}
    _, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    looped = 0
    for key, row in plain.items():
        ids, got = _ids(row), stopped[key]
        loop = first_loop(ids)
        if loop is None:  # no loop within its tokens: the row as the engine makes it
            assert (got["generated_text"], got["finish_reason"]) == (
                row["generated_text"],
                row["finish_reason"],
            )
            continue
        looped += 1
        n, keep = loop
        assert got["finish_reason"] == "repetition" and got["completion_tokens"] == n
        assert _ids(got) == ids[:n]  # the same tokens up to the stop
        assert got["generated_text"] == tokenizer.decode(ids[:keep])
    assert looped >= 3 and first_loop(_ids(plain["short"])) is None
    assert f"{looped} rows stopped repeating themselves" in text
    code, text = run_cli("inspect", str(tmp_path / "stopped.parquet"))
    assert f"loops: {looped} rows ended repeating themselves" in text


def test_the_sample_never_triggers_it(tmp_path):
    outs = []
    for name, extra in (("plain", ()), ("stopped", ("--stop-repetition", "64"))):
        out = tmp_path / f"{name}.parquet"
        code, text = run_cli("run", str(SAMPLE / "jobs.jsonl"), "-o", str(out), "-q", *extra)
        assert code == 0, text
        outs.append([(r["id"], r["generated_text"], r["finish_reason"]) for r in read(out)])
    assert outs[0] == outs[1] and all(reason != "repetition" for _, _, reason in outs[1])


def test_the_one_row_lane_stops_the_same_way():
    tokens = [3, 4] + [7, 8, 9] * 40
    stream = (SimpleNamespace(token=t, prompt_tokens=5, logprobs=None) for t in tokens)
    tokenizer = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    traits = Traits(tokenizer, markers=None, tool_format=None)
    gen = collect(stream, GenParams(max_tokens=500, stop_repetition=SPAN), traits, {0})
    n, keep = first_loop(tokens)
    assert (gen.finish_reason, gen.completion_tokens, gen.text) == (
        "repetition",
        n,
        tokenizer.decode(tokens[:keep]),
    )
    assert n == 2 + SPAN  # within 64 tokens of the loop's start
    loops = Loops(SPAN)
    assert all(loops.cut(list(range(k + 1))) is None for k in range(300))  # no cycle, no stop


def test_a_bad_value_is_the_rows_error(tmp_path):
    rows = [
        {"id": "a", "prompt": "x", "stop_repetition": 3},
        {"id": "b", "prompt": "y", "stop_repetition": True},
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "o.parquet"
    code, text = run_cli(
        "run", str(job), "-o", str(out), "--model", str(MODELS / "tiny-lm"), "--max-tokens", "4"
    )
    rows = {r["id"]: r for r in read(out)}
    assert code == 1 and rows["a"]["error_stage"] == "read" and "stop_repetition" in rows["a"]["error"]
    assert rows["b"]["status"] == "ok"


def test_redo_repetition_generates_the_looped_rows_again_with_a_penalty(tmp_path):
    rows = [
        {"id": f"r{i}", "prompt": f"Tell me about item {i} and more.", "max_tokens": 120} for i in range(4)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "o.parquet"
    base = ["run", str(job), "-o", str(out), "--model", str(MODELS / "tiny-lm"), "--temperature", "0", "-q",
            "--stop-repetition", "64"]  # fmt: skip
    code, text = run_cli(*base)
    assert code == 0, text
    first = {r["id"]: r for r in read(out)}
    looped = {k for k, r in first.items() if r["finish_reason"] == "repetition"}
    assert looped, first
    code, text = run_cli(*base, "--redo-repetition", "1.5")
    assert code == 0 and f"{len(looped)} looping rows generated again" in text, text
    again = {r["id"]: r for r in read(out)}
    for key, row in again.items():
        if key in looped:  # another penalty: other tokens
            assert row["generated_text"] != first[key]["generated_text"]
        else:
            assert row == first[key]
    code, text = run_cli(*base)  # a plain rerun keeps them: nothing to do
    assert code == 0 and "nothing to do" in text, text
    code, text = run_cli(*base, "--redo-repetition", "1.5", "--engine", "ray")
    assert code == 2 and "--redo-repetition" in text

"""The memory budget: rows join a batch while it fits, a row too big alone is its error before
any work, and an out-of-memory mid-batch costs the batch a retry in halves, not the run."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from conftest import MODELS, read, run_cli, write_jsonl

from batchgen.core.budget import budget_spec, parse_size
from batchgen.core.errors import ConfigError
from batchgen.generate.decode.adapters import LMAdapter
from batchgen.generate.decode.memory import batch_need, footprint, out_of_memory, weights_bytes
from batchgen.tools.tiny.parts import WORDS

LM = MODELS / "tiny-lm"
BASE = ["--model", str(LM), "--temperature", "0", "--max-tokens", "32", "-q"]
OOM = "[metal::malloc] Resource limit (499000) exceeded."  # MLX's allocator, word for word


def _mixed(tmp_path, short=40, long=6, words=400):
    """Short rows and a few long ones (prompts 40x longer), shuffled."""
    rng = random.Random(0)
    rows = [{"id": f"s{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(10))} for i in range(short)]
    rows += [{"id": f"l{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(words))}
             for i in range(long)]  # fmt: skip
    rng.shuffle(rows)
    return write_jsonl(tmp_path / "jobs.jsonl", rows)


def _run(job, out, *extra):
    mx.reset_peak_memory()
    code, text = run_cli("run", str(job), "-o", str(out), *BASE, *extra)
    peak = mx.get_peak_memory()
    stats = json.loads(out.with_name(out.name + ".stats.json").read_text())
    return code, text, {r["id"]: r for r in read(out)}, stats, peak


def test_budgets_are_read_as_people_write_them():
    assert parse_size("8GB") == 8 * 10**9 and parse_size("7.5GiB") == int(7.5 * 2**30)
    assert parse_size("512 MiB") == 512 * 2**20 and parse_size("1500000000") == 1_500_000_000
    assert budget_spec("60%").share == 0.6 and budget_spec("auto").size is None
    assert budget_spec("off") is None and budget_spec(None) is None
    for bad in ("lots", "8 parsecs", "0%", "150%", "12", "9" * 40):
        with pytest.raises(ConfigError, match="--memory-budget"):
            budget_spec(bad)


def test_a_bad_budget_stops_the_run_before_it_starts(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "hi"}])
    code, text = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), *BASE, "--memory-budget", "much")
    assert code == 2 and "--memory-budget" in text and "8GB" in text
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.slow  # long rows decoded under a budget (16 s)
def test_under_a_budget_long_rows_run_narrow_within_it_and_outputs_do_not_change(tmp_path):
    import mlx_lm

    job = _mixed(tmp_path, words=1000)
    code, text, free, _, free_peak = _run(job, tmp_path / "free.parquet", "--memory-budget", "off")
    assert code == 0, text
    model, _ = mlx_lm.load(str(LM))  # the budget: room for 24 short rows, or a long one alone
    fp = footprint(model, LMAdapter(model).make_cache())
    short, long = (max(r["prompt_tokens"] for k, r in free.items() if k[0] == c) for c in "sl")
    alone = batch_need(fp, [long + 32], long)
    budget = weights_bytes(model) + int(max(batch_need(fp, [short + 32] * 24, short), 1.1 * alone))
    del model
    code, text, held, stats, peak = _run(job, tmp_path / "held.parquet", "--memory-budget", str(budget))
    assert code == 0, text
    assert {k: r["generated_text"] for k, r in held.items()} == {
        k: r["generated_text"] for k, r in free.items()
    }
    assert all(r["status"] == "ok" for r in held.values())
    memory = stats["memory"]
    assert memory["budget"] == budget and memory["out_of_memory"] == 0 and memory["too_big"] == 0
    widths = {int(w): n for w, n in memory["widths"].items()}
    assert max(widths) >= 20 and min(widths) <= 6  # short rows wide, the 6 long ones narrow
    assert free_peak > 2 * budget and peak <= budget * 1.1, (peak, budget, free_peak)  # MLX's own peak


def test_a_row_too_big_alone_is_its_error_before_any_work_and_the_others_finish(tmp_path):
    job = _mixed(tmp_path, short=12, long=2)
    code, text, free, *_ = _run(job, tmp_path / "free.parquet", "--memory-budget", "off")
    code, text, rows, stats, _ = _run(job, tmp_path / "held.parquet", "--memory-budget", "6MB")
    assert code == 1
    for key, row in rows.items():
        if key.startswith("l"):
            assert row["status"] == "error" and row["error_stage"] == "generate" and not row["transient"]
            assert "too big for the memory budget even alone" in row["error"]
            assert "--memory-budget 6MB" in row["error"]
            assert row["completion_tokens"] == 0
        else:
            assert row["status"] == "ok" and row["generated_text"] == free[key]["generated_text"]
    assert stats["memory"]["too_big"] == 2 and "2 rows too big for the memory budget" in text


def test_an_out_of_memory_mid_batch_retries_the_batch_in_halves(tmp_path, monkeypatch):
    rng = random.Random(1)
    rows = [{"id": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))}
            for i in range(8)]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, text, clean, *_ = _run(job, tmp_path / "clean.parquet", "--batch-size", "8")
    assert code == 0, text

    decode, calls = LMAdapter.decode, []

    def failing(self, tokens, cache, seqs, ahead=0):
        calls.append(tokens.shape[0])
        if len(calls) == 5 and tokens.shape[0] == 8:  # the fifth decode step of the batch of 8
            raise RuntimeError(OOM)
        return decode(self, tokens, cache, seqs, ahead)

    monkeypatch.setattr(LMAdapter, "decode", failing)
    code, text, again, stats, _ = _run(job, tmp_path / "again.parquet", "--batch-size", "8")
    assert code == 0, text
    assert calls[4] == 8 and max(calls[5:]) <= 4  # the halves, after the failure
    assert {k: (r["status"], r["generated_text"], r["completion_tokens"]) for k, r in again.items()} == {
        k: (r["status"], r["generated_text"], r["completion_tokens"]) for k, r in clean.items()
    }
    memory = stats["memory"]
    assert memory["out_of_memory"] == 1 and memory["retried"] == 8 and memory["ceiling"] is not None
    assert "1 out-of-memory batches split in halves (8 rows run again)" in text


def test_an_out_of_memory_with_a_row_alone_is_that_rows_error(tmp_path, monkeypatch):
    rows = [{"id": "a", "prompt": "one two"}, {"id": "b", "prompt": "three"}]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    decode = LMAdapter.decode

    def failing(self, tokens, cache, seqs, ahead=0):
        if any(s is not None and len(s.tokens) == 3 for s in seqs):  # every try fails at its third token
            raise RuntimeError(OOM)
        return decode(self, tokens, cache, seqs, ahead)

    monkeypatch.setattr(LMAdapter, "decode", failing)
    code, text, rows, stats, _ = _run(job, tmp_path / "o.parquet", "--batch-size", "2")
    assert code == 1 and {r["status"] for r in rows.values()} == {"error"}
    assert all("out of memory with the row alone" in r["error"] and OOM in r["error"] for r in rows.values())


def test_only_allocation_failures_count_as_out_of_memory():
    for text in (OOM, "[malloc] Unable to allocate 1073741824 bytes.", "CUDA error: out of memory",
                 "[METAL] Command buffer execution failed: Insufficient Memory"):  # fmt: skip
        assert out_of_memory(RuntimeError(text))
    assert not out_of_memory(RuntimeError("shapes (1,2) and (3,4) cannot be broadcast"))
    assert not out_of_memory(ValueError(OOM))

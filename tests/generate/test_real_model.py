"""A real pretrained model (SmolLM2-135M-Instruct, Q4): batchgen's rows are mlx-lm's own, and
the loop stop ends the loop the model really falls into and nothing else."""

from __future__ import annotations

import json

import pytest
from conftest import read, run_cli, write_jsonl
from test_loops import first_loop

pytestmark = pytest.mark.slow  # a 135M model on the CPU: about 7 tokens a second for one row

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Say hello in Spanish."]
LONG = ["Describe a busy train station in the morning.", "Write a short story about a lighthouse keeper."]


def _prompt(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip


def test_rows_are_mlx_lms_own_batched_and_one_at_a_time(tmp_path, real_lm):
    import mlx_lm

    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": i, "prompt": q} for i, q in enumerate(QUESTIONS)])
    base = ["--model", str(real_lm), "--temperature", "0", "--max-tokens", "10", "-q"]
    outputs = []
    for name, extra in (("batched", ()), ("alone", ("--batch-size", "1", "--no-cache"))):
        code, text = run_cli("run", str(job), "-o", str(tmp_path / f"{name}.parquet"), *base, *extra)
        assert code == 0, text
        outputs.append([r["generated_text"] for r in read(tmp_path / f"{name}.parquet")])
    model, tokenizer = mlx_lm.load(str(real_lm))
    reference = [mlx_lm.generate(model, tokenizer, _prompt(tokenizer, q), max_tokens=10) for q in QUESTIONS]
    assert outputs[0] == outputs[1] == reference
    assert outputs[0][0] == "The capital of France is Paris."


def test_the_haiku_loop_ends_at_its_loop(tmp_path, real_lm):
    import mlx_lm

    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "haiku", "prompt": "Write a haiku about rain."}])
    flags = ["--temperature", "0", "--max-tokens", "128", "--stop-repetition", "64", "-q"]
    code, text = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), "--model", str(real_lm), *flags)
    assert code == 0, text
    (row,) = read(tmp_path / "o.parquet")
    assert row["finish_reason"] == "repetition" and row["completion_tokens"] < 128
    model, tokenizer = mlx_lm.load(str(real_lm))
    prompt = _prompt(tokenizer, "Write a haiku about rain.")
    ids = [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=row["completion_tokens"])
    ]
    n, keep = first_loop(ids)  # mlx-lm's own tokens loop exactly where the row stopped
    assert n == row["completion_tokens"] and row["generated_text"] == tokenizer.decode(ids[:keep])
    assert n - (keep - 1) <= 64 + 32  # within the span of the loop's start


def test_long_plain_answers_never_trigger_it(tmp_path, real_lm):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": i, "prompt": q} for i, q in enumerate(LONG)])
    flags = ["--temperature", "0", "--max-tokens", "96", "--stop-repetition", "64", "-q"]
    code, text = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), "--model", str(real_lm), *flags)
    assert code == 0, text
    rows = read(tmp_path / "o.parquet")
    assert all(r["completion_tokens"] > 64 for r in rows)  # long enough for the stop to act
    assert all(r["finish_reason"] != "repetition" for r in rows), json.dumps(
        [r["generated_text"] for r in rows]
    )

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


CITIES = [("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo")]


def test_constraints_logprobs_and_scores_on_a_real_model(tmp_path, real_lm):
    import jsonschema
    import mlx_lm

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    names = [city for _, city in CITIES]
    answers = [f"The capital is {city}." for city in names]  # as an instruct model answers
    rows = [
        {"id": "schema", "prompt": "Give the capital of France as JSON.", "json_schema": schema,
         "max_tokens": 24},
        {"id": "choice", "prompt": "Which is the capital of Italy?", "guided_choice": names, "max_tokens": 8},
        {"id": "regex", "prompt": "Give a year.", "guided_regex": "[12][0-9]{3}", "max_tokens": 8},
        {"id": "lp", "prompt": "What is the capital of France?", "max_tokens": 6, "top_logprobs": 3},
    ] + [
        {"id": f"c{k}", "prompt": f"What is the capital of {country}?", "choices_to_score": answers,
         "score_only": True}
        for k, (country, _) in enumerate(CITIES)
    ]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "o.parquet"
    code, text = run_cli("run", str(job), "-o", str(out), "--model", str(real_lm), "--temperature", "0", "-q")
    assert code == 0, text
    got = {r["id"]: r for r in read(out)}
    jsonschema.validate(json.loads(got["schema"]["generated_text"]), schema)
    assert got["choice"]["generated_text"] in names and len(got["regex"]["generated_text"]) == 4
    model, tokenizer = mlx_lm.load(str(real_lm))
    prompt = tokenizer.encode(_prompt(tokenizer, "What is the capital of France?"), add_special_tokens=False)
    reference = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=6))
    ours = got["lp"]["logprobs"]
    assert [r["id"] for r in ours] == [r.token for r in reference]
    for record, r in zip(ours, reference, strict=True):
        assert abs(record["logprob"] - r.logprobs[r.token].item()) < 1e-3
    ranked = [max(got[f"c{k}"]["choice_scores"], key=lambda c: c["logprob"])["choice"] for k in range(3)]
    assert ranked == answers  # the right capital first for each question

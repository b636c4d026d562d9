"""Structured output: rows constrained to a JSON schema, a choice or a regex get output that
satisfies it, batched with unconstrained rows and each other, on every lane; a row that
cannot finish its JSON within max_tokens is an error, never invalid JSON marked ok. Random
tiny models are enough here: the constraint, not the model, makes the output valid."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from conftest import MODELS, read, run_cli, write_jsonl
from PIL import Image

LM, VLM = str(MODELS / "tiny-lm"), str(MODELS / "tiny-vlm")

# Bounded schemas: whatever a random model picks, every path ends within the token budget.
SCHEMAS = [
    {"type": "object", "properties": {"caption": {"type": "string", "maxLength": 24},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3},
                                      "colour": {"enum": ["red", "green", "blue", "black"]}},
     "required": ["caption", "tags", "colour"], "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}},
     "required": ["count", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"short": {"type": "string", "maxLength": 10},
                                      "score": {"enum": [0, 0.5, 1]}},
     "required": ["short", "score"], "additionalProperties": False},
]  # fmt: skip


def _run(job, out, *flags, model=LM):
    code, output = run_cli(
        "run", str(job), "-o", str(out), "--model", model, "--temperature", "0", "-q", *flags
    )
    return code, output, {r["id"]: r for r in read(out)}


@pytest.mark.slow  # 64 constrained rows
def test_64_rows_under_4_schemas_in_one_batch_all_parse_and_validate(tmp_path):
    rows = [
        {"id": f"r{k}", "prompt": f"Describe thing number {k} in JSON.", "json_schema": SCHEMAS[k % 4],
         "max_tokens": 96}
        for k in range(64)
    ]  # fmt: skip
    rows += [
        {"id": "free", "prompt": "Say anything.", "max_tokens": 12}
    ]  # batched beside them, unconstrained
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, output, got = _run(job, tmp_path / "out.parquet", "--batch-size", "64")
    assert code == 0, output
    for k in range(64):
        row = got[f"r{k}"]
        value = json.loads(row["generated_text"])
        jsonschema.validate(value, SCHEMAS[k % 4])
        assert json.loads(row["parsed"]) == value and row["finish_reason"] == "stop"
    assert len({got[f"r{k}"]["generated_text"] for k in range(64)}) > 8  # rows differ: each its own mask
    assert got["free"]["parsed"] is None and got["free"]["completion_tokens"] == 12


def test_choice_and_regex_rows_and_cache_and_batching_change_nothing(tmp_path):
    choices = [["yes", "no"], ["red", "green", "blue"], ["a long answer", "short"]]
    rows = [{"id": f"c{k}", "prompt": f"Question {k}?", "guided_choice": choices[k % 3]} for k in range(9)]
    rows += [
        {"id": f"x{k}", "prompt": f"Code {k}?", "guided_regex": r"[A-Z]{2}-[0-9]{2,4}"} for k in range(4)
    ]
    rows += [{"id": f"j{k}", "system": "Answer in JSON.", "prompt": f"Item {k}.", "json_schema": SCHEMAS[1]}
             for k in range(4)]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    _, _, fast = _run(job, tmp_path / "fast.parquet", "--max-tokens", "40")
    _, _, slow = _run(job, tmp_path / "slow.parquet", "--max-tokens", "40", "--batch-size", "1", "--no-cache")
    assert {k: r["generated_text"] for k, r in fast.items()} == {
        k: r["generated_text"] for k, r in slow.items()
    }
    for k in range(9):
        assert fast[f"c{k}"]["generated_text"] in choices[k % 3] and fast[f"c{k}"]["status"] == "ok"
    for k in range(4):
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", fast[f"x{k}"]["generated_text"])
        jsonschema.validate(json.loads(fast[f"j{k}"]["generated_text"]), SCHEMAS[1])


def test_image_rows_are_constrained_on_the_batched_and_the_one_row_lanes(workdir, offset_families):
    """Image rows on the batched Qwen-VL lane, and image rows of a Gemma 4 whose image tokens
    attend both ways, which go through mlx-vlm's own generate one at a time: both constrained,
    both the same on and off."""
    import shutil

    rng = np.random.default_rng(1)
    for k in range(2):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(workdir / f"p{k}.png")
    rows = [{"id": f"i{k}", "image": f"p{k % 2}.png", "prompt": "Tag it.", "json_schema": SCHEMAS[k % 4]}
            for k in range(4)]  # fmt: skip
    single = [{"id": f"s{k}", "image": f"p{k}.png", "prompt": "Same?", "guided_choice": ["same", "different"]}
              for k in range(2)]  # fmt: skip
    bidirectional = workdir / "gemma4-bidirectional"
    shutil.copytree(offset_families["gemma4"], bidirectional)
    config = json.loads((bidirectional / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (bidirectional / "config.json").write_text(json.dumps(config))
    flags = ("--max-tokens", "64")
    for model, batch, name in ((VLM, rows, "batched"), (str(bidirectional), single, "one-row")):
        job = write_jsonl(workdir / f"{name}.jsonl", batch)
        code, output, fast = _run(job, workdir / f"{name}-fast.parquet", *flags, model=model)
        assert code == 0, output
        _, _, slow = _run(job, workdir / f"{name}-slow.parquet", *flags, "--batch-size", "1", "--no-cache",
                          model=model)  # fmt: skip
        assert {k: r["generated_text"] for k, r in fast.items()} == {
            k: r["generated_text"] for k, r in slow.items()
        }
        if name == "batched":
            for k in range(4):
                jsonschema.validate(json.loads(fast[f"i{k}"]["generated_text"]), SCHEMAS[k % 4])
        else:
            assert all(r["generated_text"] in ("same", "different") for r in fast.values())
            stats = json.loads((workdir / "one-row-fast.parquet.stats.json").read_text())
            assert list(stats["one_at_a_time"].values()) == [2]  # gemma4: its image tokens attend both ways


def test_a_row_that_cannot_finish_its_json_is_an_error_not_invalid_json_marked_ok(tmp_path):
    rows = [
        {"id": "cut", "prompt": "Describe it.", "json_schema": SCHEMAS[0], "max_tokens": 4},
        {
            "id": "bad-schema",
            "prompt": "x",
            "json_schema": {"type": "object", "properties": {"a": {"type": 5}}},
        },
        {"id": "two", "prompt": "x", "json_schema": SCHEMAS[1], "guided_regex": "a+"},
        {"id": "empty-choice", "prompt": "x", "guided_choice": []},
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, output, got = _run(job, tmp_path / "out.parquet")
    assert code == 1
    cut = got["cut"]
    assert cut["status"] == "error" and cut["finish_reason"] == "length" and cut["parsed"] is None
    assert cut["error"] == (
        "the output is not complete JSON: it does not satisfy its JSON schema within max_tokens 4 "
        "(finish_reason length)"
    )
    assert (
        got["bad-schema"]["error_stage"] == "read"
        and "json_schema: cannot be compiled" in got["bad-schema"]["error"]
    )
    assert "guided_regex: give one of json_schema, guided_regex, not several" in got["two"]["error"]
    assert "guided_choice: expected a list of non-empty strings" in got["empty-choice"]["error"]


def test_a_run_wide_schema_and_openai_response_format(tmp_path):
    schema_file = tmp_path / "caption.json"
    schema_file.write_text(json.dumps(SCHEMAS[0]))
    rows = [{"id": "a", "prompt": "A cat."}, {"id": "b", "prompt": "Pick.", "guided_choice": ["x", "y"]}]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, output, got = _run(
        job, tmp_path / "out.parquet", "--json-schema", str(schema_file), "--max-tokens", "96"
    )
    assert code == 0, output
    jsonschema.validate(json.loads(got["a"]["generated_text"]), SCHEMAS[0])
    assert got["b"]["generated_text"] in ("x", "y")  # a row's own constraint wins

    response_format = {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMAS[1]}}
    request = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "max_tokens": 96, "temperature": 0, "messages": [{"role": "user", "content": "Count."}],
        "response_format": response_format}}  # fmt: skip
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps(request) + "\n")
    out = tmp_path / "batch_out.jsonl"
    code, output = run_cli(
        "run", str(batch), "-o", str(out), "--output-format", "openai", "--model", LM, "-q"
    )
    assert code == 0, output
    line = json.loads(out.read_text())
    content = line["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMAS[1])
    assert line["response"]["body"]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("flag", [("--guided-choice", "a", "--guided-regex", "b+")])
def test_two_run_wide_constraints_are_a_setting_error(tmp_path, flag):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "x"}])
    code, output = run_cli("run", str(job), "-o", str(tmp_path / "o.parquet"), "--model", LM, *flag)
    assert code == 2 and "not several" in output


def test_an_object_schema_generates_only_the_properties_it_names(tmp_path):
    """xgrammar's, outlines' and vLLM's rule: no `additionalProperties` means none. Under
    llguidance's own default a random model invents keys until max_tokens and every row fails."""
    shade = {"type": "object", "properties": {"dark": {"type": "boolean"}}}
    colour, size = {"enum": ["red", "green", "blue"]}, {"enum": ["small", "large"]}
    schema = {"type": "object", "properties": {"colour": colour, "size": size, "shade": shade}}
    rows = [
        {"id": f"r{i}", "prompt": f"Describe thing {i} in JSON.", "json_schema": schema} for i in range(12)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    code, output, got = _run(job, tmp_path / "out.parquet", "--max-tokens", "48")
    assert code == 0, output
    for row in got.values():
        value = json.loads(row["parsed"])
        assert set(value) <= {"colour", "size", "shade"} and set(value.get("shade", {})) <= {"dark"}
        jsonschema.validate(value, {**schema, "additionalProperties": False})
    assert any(json.loads(r["parsed"]) for r in got.values())  # not only empty objects

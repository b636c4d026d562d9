"""Thinking models: on tiny checkpoints with Qwen3's `<think>` markers (and its enable_thinking
template) and Gemma 4's two-token `<|channel>thought` … `<channel|>`, batched rows are token
for token mlx-lm's own generate with the same template, and their reasoning and answer are
mlx-lm's server's split of it; a budget ends reasoning where it says; a constraint applies to
the answer only; scores are the answer's after a closed block. The checkpoints are
"sensitive" (their output follows the prompt) and the rows bias the marker tokens a little,
so some rows close their block early, some late and some never."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import read, run_cli, write_jsonl

from batchgen.tools.tiny.builder import make_tiny_model

pytestmark = pytest.mark.slow  # token for token against mlx-lm


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "think", "thinking-lm", sensitive=True)


@pytest.fixture(scope="module")
def channel(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "channel", "channel-lm", sensitive=True)


def _run(tmp_path, model, rows, *flags):
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / f"{model.name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(model), "--temperature", "0",
                           "-q", *flags)  # fmt: skip
    assert code == 0, output
    return {r["id"]: r for r in read(out)}


def _reference(model_dir, row, **template):
    """mlx-lm's stream_generate on the row's prompt, and its server's split of the stream: the
    text fed to its state machine as it grows token by token (decoded whole each time, as the
    output's text is: mlx-lm's streaming detokenizer leaves a random model's control bytes
    undecoded, a difference of detokenizers, not of the split)."""
    import mlx_lm
    from mlx_lm.generate import TextStateMachine, make_text_state_machine
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = mlx_lm.load(str(model_dir))
    messages = [{"role": "user", "content": row["prompt"]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template)
    bias = {int(k): v for k, v in row.get("logit_bias", {}).items()}
    procs = make_logits_processors(logit_bias=bias or None)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=row["max_tokens"],
                                                      logits_processors=procs)]  # fmt: skip
    said = tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens
    opened = tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)
    state = make_text_state_machine(tokenizer).make_state("reasoning" if opened else "normal")
    texts, fed = {"reasoning": "", "normal": ""}, ""
    for k in range(1, len(said) + 1):
        text = tokenizer.decode(said[:k])
        if k < len(said) and (text.endswith("\ufffd") or not text.startswith(fed)):
            continue  # a character not complete yet
        state, segments = TextStateMachine.split(state, text[len(fed) :])
        fed = text
        for part, chunk in segments:
            texts[part] += chunk
    state, rest, last = TextStateMachine.flush(state)
    texts[last] += rest
    return tokens, texts["reasoning"], texts["normal"].strip()  # the reasoning as the server keeps it


def _rows(bias, n=8, max_tokens=48):
    return [
        {"id": f"r{k}", "prompt": f"Think about {k} red things and {8 - k} blue ones.",
         "max_tokens": max_tokens, "logit_bias": {str(t): b * (1 + k % 3) / 2 for t, b in bias.items()},
         "logprobs": True}
        for k in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "bias"),
    [("thinking", {8: 1.0}), ("channel", {7: 1.5, 1024: 2.5, 8: 1.0})],
    ids=["think-tags", "gemma4-channel"],
)
def test_unconstrained_rows_are_mlx_lms_tokens_and_its_servers_split(tmp_path, request, kind, bias):
    model = request.getfixturevalue(kind)
    rows = _rows(bias)
    got = _run(tmp_path, model, rows, "--thinking", "on", "--batch-size", "8")
    reasoned = 0
    for row in rows:
        tokens, reasoning, answer = _reference(model, row, enable_thinking=True)
        ours = got[row["id"]]
        assert [r["id"] for r in ours["logprobs"]] == tokens, row["id"]
        assert (ours["reasoning"] or "", ours["generated_text"].strip()) == (reasoning, answer), row["id"]
        parts = [r["part"] for r in ours["logprobs"]]
        assert ours["reasoning_tokens"] <= parts.count("reasoning")
        assert ours["completion_tokens"] == len(tokens)
        reasoned += bool(reasoning) and bool(answer)
    assert reasoned >= 2  # rows that closed their block and answered after it


def test_thinking_off_writes_the_templates_closed_block_or_an_empty_one(tmp_path, thinking, channel):
    rows = _rows({8: 1.0}, n=3, max_tokens=16)
    for model, template in ((thinking, {"enable_thinking": False}), (channel, {})):
        got = _run(tmp_path, model, rows, "--thinking", "off")
        for row in rows:
            ours = got[row["id"]]
            assert ours["reasoning"] is None and ours["reasoning_tokens"] == 0
            assert {r["part"] for r in ours["logprobs"]} == {"answer"}
        if template:  # Qwen3's template writes the block itself: mlx-lm's tokens with it
            tokens, reasoning, _ = _reference(model, rows[0], **template)
            assert [r["id"] for r in got["r0"]["logprobs"]] == tokens and not reasoning


def test_a_budget_of_16_ends_reasoning_at_16_tokens_and_the_answer_keeps_max_tokens(
    tmp_path, thinking, channel
):
    for model, bias in ((thinking, {}), (channel, {7: 30.0})):  # the channel row must open its block itself
        rows = _rows(bias, n=3, max_tokens=12)
        got = _run(tmp_path, model, rows, "--thinking", "on", "--reasoning-budget", "16")
        for row in rows:
            ours = got[row["id"]]
            parts = [r["part"] for r in ours["logprobs"]]
            assert ours["reasoning_tokens"] == 16, (model.name, row["id"], parts)
            answer = [r for r in ours["logprobs"] if r["part"] == "answer"]
            assert len(answer) == 12 or ours["finish_reason"] == "stop"
            ids = [r["id"] for r in ours["logprobs"]]
            end = 16 if model == thinking else 16 + 2  # Gemma 4's block opens with two tokens
            assert ids[end] == 8  # the end marker, forced


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}  # fmt: skip


def test_a_schema_row_thinks_first_and_answers_valid_json(tmp_path, thinking, channel):
    for model, bias in ((thinking, {}), (channel, {7: 30.0})):
        rows = [{**row, "json_schema": SCHEMA} for row in _rows(bias, n=3, max_tokens=40)]
        rows.append({"id": "choice", "prompt": "Red or blue?", "guided_choice": ["red", "blue"],
                     "max_tokens": 8, "logprobs": True})  # fmt: skip
        got = _run(tmp_path, model, rows, "--thinking", "on", "--reasoning-budget", "6")
        for row in rows:
            ours = got[row["id"]]
            assert ours["status"] == "ok" and ours["reasoning"] and ours["reasoning_tokens"] == 6, ours
            if "json_schema" in row:
                jsonschema.validate(json.loads(ours["generated_text"]), SCHEMA)
                assert json.loads(ours["parsed"]) == json.loads(ours["generated_text"])
            else:
                assert ours["generated_text"] in ("red", "blue")


def test_scores_are_the_answers_after_the_templates_thinking_off_text(tmp_path, thinking, channel):
    import mlx.core as mx
    import mlx_lm

    from batchgen.generate.lanes.scoring import answer_ids

    choices = ["red", "blue things", "none"]
    rows = [{"id": f"q{k}", "prompt": f"Which colour is {k}?", "choices_to_score": choices,
             "score_only": True} for k in range(2)]  # fmt: skip
    rows.append({"id": "t", "prompt": "Say a colour.", "score_text": "It is red."})
    # Qwen3's template opens the block with thinking on and writes `<think>\n\n</think>\n\n` with
    # it off; Gemma 4's leaves the row to open it, and leaves `<|think|>` out with it off. Either
    # way the answer is scored after exactly the template's thinking-off text.
    for model in (thinking, channel):
        got = _run(tmp_path, model, rows, "--thinking", "on")
        lm, tokenizer = mlx_lm.load(str(model))
        for row in rows:
            messages = [{"role": "user", "content": row["prompt"]}]
            off = {"add_generation_prompt": True, "enable_thinking": False}
            prompt = tokenizer.apply_chat_template(messages, **off)
            answers = row.get("choices_to_score") or [row["score_text"]]
            expected = []
            for answer in answers:
                ids = answer_ids(tokenizer, answer, set(tokenizer.eos_token_ids))
                lp = lm(mx.array([prompt + ids]))[0].astype(mx.float32)
                lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
                expected.append(sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids)))
            if "score_text" in row:
                assert abs(got["t"]["score_logprob"] - expected[0]) < 1e-4, model.name
            else:
                scores = [c["logprob"] for c in got[row["id"]]["choice_scores"]]
                assert all(abs(a - b) < 1e-4 for a, b in zip(scores, expected, strict=True)), model.name


def test_an_openai_batch_output_carries_the_reasoning_apart(tmp_path, thinking):
    from openai.types.chat import ChatCompletion

    requests = [{"custom_id": f"c{k}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "max_tokens": 12, "temperature": 0, "reasoning_budget": 8,
                          "messages": [{"role": "user", "content": f"Think of {k}."}]}}
                for k in range(2)]  # fmt: skip
    job = tmp_path / "batch.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out.jsonl"
    code, output = run_cli("run", str(job), "-o", str(out), "--output-format", "openai",
                           "--model", str(thinking), "--thinking", "on", "-q")  # fmt: skip
    assert code == 0, output
    rows = {r["id"]: r for r in read(tmp_path / "out.parquet")}
    for line in map(json.loads, out.read_text().splitlines()):
        body = ChatCompletion.model_validate(line["response"]["body"])
        message, row = body.choices[0].message, rows[line["custom_id"]]
        assert (
            message.content == row["generated_text"] and message.reasoning_content == row["reasoning"] != ""
        )
        assert body.usage.completion_tokens_details.reasoning_tokens == row["reasoning_tokens"] == 8
        assert body.usage.completion_tokens == row["completion_tokens"]


def test_inspect_and_the_gallery_show_the_answer_with_the_reasoning_folded(tmp_path, thinking):
    rows = _rows({}, n=2, max_tokens=6) + [{"id": "long", "prompt": "Think hard.", "max_tokens": 4}]
    got = _run(tmp_path, thinking, rows[:2], "--thinking", "on", "--reasoning-budget", "4")
    out = tmp_path / "think.parquet"
    page = tmp_path / "gallery.html"
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    html = page.read_text()
    marker = '<script id="data" type="application/json">'
    start = html.index(marker) + len(marker)
    entries = {e["id"]: e for c in json.loads(html[start : html.index("</script>", start)])["cards"]
               for e in c["entries"]}  # fmt: skip
    for row_id, row in got.items():
        assert (
            entries[row_id]["text"] == row["generated_text"]
            and entries[row_id]["reasoning"] == row["reasoning"]
        )
    assert 'el("details"' in html  # the page folds the reasoning away under the answer
    text = run_cli("inspect", str(out))[1]
    assert "reasoning: 2 rows reasoned first, 8 reasoning tokens" in text, text
    _run(tmp_path, thinking, rows[2:], "--thinking", "on", "--overwrite")  # no budget: out of tokens
    text = run_cli("inspect", str(out))[1]
    assert "1 gave no answer (out of tokens while reasoning" in text, text

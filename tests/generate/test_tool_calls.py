"""Tool calls: a row's tools reach the chat template, its answer is read with mlx-lm's parser
for the model's format into `tool_calls` (a typed column, and `message.tool_calls` in an
OpenAI Batch output that the `openai` package's types accept), and a tool_choice naming a
function constrains the call to that function's parameters. The tiny thinking-lm has Qwen3's
`<tool_call>` JSON format; a random model makes valid calls only when constrained, so the
parser's reading of free text is checked on written answers."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import MODELS, read, run_cli, write_jsonl

from batchgen.core.params import GenParams
from batchgen.core.records import Generation
from batchgen.generate.chat.tool_calls import with_tool_calls
from batchgen.generate.chat.traits import Traits
from batchgen.tools.tiny.builder import make_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "think", "thinking-lm", sensitive=True)


def _function(name):
    return {"type": "function", "function": {"name": name}}


def test_a_written_call_is_read_with_mlx_lms_parser_and_a_broken_one_left_as_text(qwen3):
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(qwen3))
    fmt = Traits.of(tokenizer).tool_format
    assert fmt is not None and fmt.name == "json_tools"
    p = GenParams(tools=tuple(TOOLS))
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    said = f"Let me look. <tool_call>\n{call_text}\n</tool_call>"
    gen = with_tool_calls(
        Generation(text=said, finish_reason="stop", prompt_tokens=5, completion_tokens=30), p, fmt
    )
    assert gen.text == "Let me look." and gen.finish_reason == "tool_calls"
    ((call,),) = [gen.tool_calls]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    two = said + '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    gen = with_tool_calls(
        Generation(text=two, finish_reason="stop", prompt_tokens=5, completion_tokens=40), p, fmt
    )
    assert [c["function"]["name"] for c in gen.tool_calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in gen.tool_calls}) == 2
    cut = 'Let me look. <tool_call>\n{"name": "get_weather", "argum'  # max_tokens ran out in the call
    gen = with_tool_calls(
        Generation(text=cut, finish_reason="length", prompt_tokens=5, completion_tokens=20), p, fmt
    )
    assert (gen.text, gen.tool_calls, gen.finish_reason) == (cut, None, "length")
    none = GenParams(tools=tuple(TOOLS), tool_choice="none")
    gen = with_tool_calls(
        Generation(text=said, finish_reason="stop", prompt_tokens=5, completion_tokens=30), none, fmt
    )
    assert (gen.text, gen.tool_calls) == (said, None)  # tool_choice none: the answer is text


@pytest.mark.slow  # three runs on a tiny model
def test_tool_choice_constrains_the_call_and_auto_leaves_the_model_free(tmp_path, qwen3):
    rows = [
        {"id": f"w{k}", "prompt": f"What is the weather in city {k}?", "tools": TOOLS,
         "tool_choice": _function("get_weather"), "max_tokens": 160}
        for k in range(3)
    ] + [
        {"id": "any", "prompt": "Call something.", "tools": TOOLS, "tool_choice": "required",
         "max_tokens": 160},
        {"id": "auto", "prompt": "Hello there.", "tools": TOOLS, "max_tokens": 12},
        {"id": "plain", "prompt": "Hello there.", "max_tokens": 12},
        {"id": "think", "prompt": "Weather in Rome?", "tools": TOOLS, "tool_choice": _function("get_weather"),
         "thinking": True, "reasoning_budget": 5, "max_tokens": 160},
        {"id": "unknown", "prompt": "x", "tools": TOOLS, "tool_choice": _function("get_news")},
        {"id": "both", "prompt": "x", "tools": TOOLS, "tool_choice": "required", "guided_choice": ["a", "b"]},
    ]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(qwen3), "--temperature", "0",
                           "--thinking", "off", "-q")  # fmt: skip
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    for row_id in ("w0", "w1", "w2", "think", "any"):
        row = got[row_id]
        assert row["status"] == "ok" and row["finish_reason"] == "tool_calls", row
        ((call,),) = [row["tool_calls"]]
        name = call["function"]["name"]
        assert name == "get_weather" or row_id == "any"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        assert row["generated_text"] == ""
    assert got["think"]["reasoning_tokens"] == 5 and got["think"]["reasoning"]
    assert got["auto"]["status"] == "ok" and got["auto"]["tool_calls"] is None
    # the tools reach the template: the prompt is longer by the tools turn
    assert got["auto"]["prompt_tokens"] > got["plain"]["prompt_tokens"] + 50
    assert (
        "names 'get_news', which is not one of the tools (get_weather, get_time)" in got["unknown"]["error"]
    )
    assert "give it or an output constraint, not both" in got["both"]["error"]


@pytest.mark.slow  # an OpenAI Batch run, read back with the openai package's own types
def test_an_openai_batch_with_tools_gives_tool_calls_the_openai_types_accept(tmp_path, qwen3):
    from openai.types.chat import ChatCompletion

    def request(custom_id, **body):
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": 160, "temperature": 0, "messages": messages,
                         "tools": TOOLS, **body}}  # fmt: skip

    requests = [request("call", tool_choice=_function("get_weather")), request("free", max_tokens=6),
                request("none", tool_choice="none", max_tokens=6)]  # fmt: skip
    job = tmp_path / "batch.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out.jsonl"
    code, output = run_cli("run", str(job), "-o", str(out), "--output-format", "openai",
                           "--model", str(qwen3), "--thinking", "off", "-q")  # fmt: skip
    assert code == 0, output
    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    bodies = {k: ChatCompletion.model_validate(v["response"]["body"]) for k, v in lines.items()}
    choice = bodies["call"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert bodies["free"].choices[0].message.tool_calls is None
    assert bodies["none"].usage.prompt_tokens < bodies["free"].usage.prompt_tokens  # no tools in its prompt


def test_tools_on_a_model_whose_template_never_shows_them_are_that_rows_error(tmp_path):
    rows = [{"id": "t", "prompt": "x", "tools": TOOLS}, {"id": "ok", "prompt": "x", "max_tokens": 2},
            {"id": "bad", "prompt": "x",
             "tools": [{"type": "function", "function": {"name": "no spaces"}}]}]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(MODELS / "tiny-lm"), "-q")
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert got["t"]["error"] == "the row has tools, but the model's chat template never shows them"
    assert got["t"]["error_stage"] == "generate" and got["ok"]["status"] == "ok"
    assert "tools: tools[0]: expected a function name of letters" in got["bad"]["error"]


def test_a_loaded_model_has_one_traits_record_read_as_it_loads(qwen3):
    """Markers and the tool-call format are read once, as the model loads, into one record the
    lanes are handed; a model loaded again reads its own (nothing is kept by the tokenizer)."""
    from batchgen.generate.router import Router

    models = Router(str(qwen3)).models
    traits = models.traits(vision=False)
    assert traits is models.traits(vision=False) and traits.tokenizer is models.text()[1]
    assert traits.markers is not None and traits.markers.start == "<think>"
    assert traits.tool_format is not None and traits.tool_format.name == "json_tools"
    models.release()
    again = models.traits(vision=False)
    assert again is not traits and again.tokenizer is not traits.tokenizer and again.markers is not None
    plain = Router(str(MODELS / "tiny-lm")).models.traits(vision=False)
    assert plain.markers is None

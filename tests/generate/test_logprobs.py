"""Token logprobs against the engines' own one-row generate (mlx-lm for text rows, mlx-vlm for
media rows), on the batched lanes and the one-row lane, with cache and batching on and off:
each generated token's logprob and its top alternatives equal the engine's within 1e-4."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import MODELS, read, run_cli, write_jsonl
from PIL import Image

from batchgen.core.params import GenParams
from batchgen.core.records import Media, MediaItem
from batchgen.generate.base.watch import Watch
from batchgen.generate.lanes.one_row import generate_vlm
from batchgen.input.parse import parse_row
from batchgen.input.read import RawRow

pytestmark = pytest.mark.slow  # token for token against both engines

TOP = 5


def _engine_records(responses, k=TOP):
    """(token, its logprob, its k likeliest (id, logprob)) from an engine's stream."""
    out = []
    for r in responses:
        lp = mx.array(r.logprobs).reshape(-1).astype(mx.float32)
        top = mx.argsort(-lp)[:k].tolist()
        out.append((int(r.token), lp[int(r.token)].item(), [(t, lp[t].item()) for t in top]))
    return out


def _same(ours, theirs):
    assert [r["id"] for r in ours] == [t for t, _, _ in theirs]
    for r, (_, lp, top) in zip(ours, theirs, strict=True):
        assert abs(r["logprob"] - lp) < 1e-4
        assert [t["id"] for t in r["top_logprobs"]] == [t for t, _ in top]
        assert all(abs(a["logprob"] - b) < 1e-4 for a, (_, b) in zip(r["top_logprobs"], top, strict=True))


def _run(job, out, *flags):
    code, output = run_cli("run", str(job), "-o", str(out), "--temperature", "0", "--max-tokens", "6", "-q",
                           "--top-logprobs", str(TOP), *flags)  # fmt: skip
    assert code == 0, output
    return {r["id"]: r for r in read(out)}


def test_text_row_logprobs_equal_mlx_lms_on_and_off_the_batch(tmp_path):
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    rows = [{"id": f"t{k}", "prompt": f"Say something about {k} {k}."} for k in range(3)]
    rows.append({"id": "pen", "prompt": "Say it again and again.", "repetition_penalty": 1.6})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    model = ("--model", str(MODELS / "tiny-lm"))
    batched = _run(job, tmp_path / "a.parquet", *model)
    alone = _run(job, tmp_path / "b.parquet", *model, "--batch-size", "1", "--no-cache")
    lm, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    tokenizer.add_eos_token("<|im_end|>")
    for row in rows:
        messages = [{"role": "user", "content": row["prompt"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        procs = make_logits_processors(repetition_penalty=row.get("repetition_penalty"))
        reference = _engine_records(
            mlx_lm.stream_generate(lm, tokenizer, ids, max_tokens=6, logits_processors=procs)
        )
        for got in (batched, alone):
            _same(got[row["id"]]["logprobs"], reference)
    assert all(
        r["logprobs"][0]["token"] == tokenizer.decode([r["logprobs"][0]["id"]]) for r in batched.values()
    )


def test_media_row_logprobs_equal_mlx_vlms_on_the_batched_and_the_one_row_lane(tmp_path, sensitive_vlm):
    import mlx_vlm

    colours = ["red", "blue"]
    for c in colours:
        Image.new("RGB", (56, 56), c).save(tmp_path / f"{c}.png")
    rows = [{"id": c, "image": str(tmp_path / f"{c}.png"), "prompt": "What is it?"} for c in colours]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    batched = _run(job, tmp_path / "a.parquet", "--model", str(sensitive_vlm))
    model, processor = mlx_vlm.load(str(sensitive_vlm))
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    for k, c in enumerate(colours):
        image = Image.open(tmp_path / f"{c}.png").convert("RGB")
        stream = mlx_vlm.stream_generate(
            model, processor, prompt, image=[image], max_tokens=6, temperature=0.0
        )
        streamed = [r for r in stream if getattr(r, "token_ids", None) is None]  # not the closing summary
        reference = _engine_records([r for r in streamed if r.token is not None])
        _same(batched[c]["logprobs"], reference)
        params = GenParams(temperature=0.0, max_tokens=6, top_logprobs=TOP)
        job_row, _ = parse_row(RawRow(k, k + 1, rows[k]), params, None)
        single = generate_vlm(model, processor, job_row, Media([MediaItem("image", image, c)]), watch=Watch())
        _same(single.logprobs, reference)
    assert batched["red"]["logprobs"] != batched["blue"]["logprobs"]  # the model sees the image


def test_logprobs_in_an_openai_batch_output_have_the_apis_shape(tmp_path):
    request = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "Hi."}]}}  # fmt: skip
    job = tmp_path / "batch.jsonl"
    job.write_text(json.dumps(request) + "\n")
    out = tmp_path / "out.jsonl"
    code, output = run_cli("run", str(job), "-o", str(out), "--output-format", "openai", "--model",
                           str(MODELS / "tiny-lm"), "-q")  # fmt: skip
    assert code == 0, output
    choice = json.loads(out.read_text())["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert (
            isinstance(item["token"], str)
            and item["logprob"] <= 0
            and item["bytes"] == list(item["token"].encode())
        )
        assert (
            len(item["top_logprobs"]) == 2
            and item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        )
        assert set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}

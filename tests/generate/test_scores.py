"""Scores against a one-row reference forward pass (the log-softmax of the model's logits over
prompt + answer, teacher-forced, in one pass without any cache): each choice's total and a
text's likelihood equal it within 1e-4, with cache and batching on and off, on text rows
(mlx-lm) and media rows (mlx-vlm); choice probabilities sum to 1."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from conftest import MODELS, read, run_cli, write_jsonl
from PIL import Image

from batchgen.generate.lanes.scoring import answer_ids

pytestmark = pytest.mark.slow  # reference forward passes on both engines

QUESTION = "Does this figure show a red circle? Please answer yes or no."


def _reference(logits: mx.array, start: int, answer: list[int]) -> float:
    """The answer's total log-probability from one forward pass's logits (1, N, V)."""
    lp = logits[0].astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    return sum(lp[start - 1 + j, t].item() for j, t in enumerate(answer))


def _run(job, out, *flags):
    code, output = run_cli("run", str(job), "-o", str(out), "-q", *flags)
    assert code == 0, output
    return {r["id"]: r for r in read(out)}


def test_choice_and_text_scores_of_text_rows_equal_a_forward_pass_of_mlx_lm(tmp_path):
    import mlx_lm

    choices = ["Yes", "No", "Maybe so"]
    rows = [{"id": f"q{k}", "prompt": f"Is {k} a small number?", "choices_to_score": choices,
             "score_only": True} for k in range(3)]  # fmt: skip
    rows.append({"id": "t", "prompt": "Describe the sky.", "score_text": "It is blue and clear today."})
    rows.append({"id": "g", "prompt": "Pick an animal.", "guided_choice": ["cat", "dog"], "max_tokens": 4})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    model = ("--model", str(MODELS / "tiny-lm"), "--temperature", "0", "--max-tokens", "3")
    batched = _run(job, tmp_path / "a.parquet", *model)
    alone = _run(job, tmp_path / "b.parquet", *model, "--batch-size", "1", "--no-cache")
    lm, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    tokenizer.add_eos_token("<|im_end|>")
    eos = set(tokenizer.eos_token_ids)
    for row in rows:
        messages = [{"role": "user", "content": row["prompt"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        answers = row.get("choices_to_score") or row.get("guided_choice") or [row["score_text"]]
        expected = []
        for answer in answers:
            ids = answer_ids(tokenizer, answer, eos)
            expected.append((_reference(lm(mx.array([prompt + ids])), len(prompt), ids), len(ids)))
        for got in (batched, alone):
            r = got[row["id"]]
            if "score_text" in row:
                ((total, n),) = expected
                assert abs(r["score_logprob"] - total) < 1e-4 and r["score_tokens"] == n
                assert abs(r["score_mean"] - total / n) < 1e-4
                continue
            scores = r["choice_scores"]
            assert [c["choice"] for c in scores] == answers
            for c, (total, n) in zip(scores, expected, strict=True):
                assert abs(c["logprob"] - total) < 1e-4 and c["tokens"] == n
            assert abs(sum(c["prob"] for c in scores) - 1) < 1e-6
            norm = math.log(sum(math.exp(t) for t, _ in expected))
            assert all(
                abs(c["prob"] - math.exp(t - norm)) < 1e-5 for c, (t, _) in zip(scores, expected, strict=True)
            )
    assert all(batched[f"q{k}"]["finish_reason"] == "score" and batched[f"q{k}"]["completion_tokens"] == 0
               for k in range(3))  # fmt: skip
    assert (
        batched["q0"]["generated_text"]
        == max(batched["q0"]["choice_scores"], key=lambda c: c["logprob"])["choice"]
    )
    assert batched["g"]["generated_text"] in ("cat", "dog") and batched["g"]["finish_reason"] == "stop"
    assert batched["t"]["generated_text"] and batched["t"]["completion_tokens"] > 0  # scored and generated


def test_scores_of_media_rows_equal_a_forward_pass_of_mlx_vlm(tmp_path, sensitive_vlm):
    import mlx_vlm
    from mlx_vlm.utils import prepare_inputs

    colours = ["red", "blue"]
    for c in colours:
        Image.new("RGB", (56, 56), c).save(tmp_path / f"{c}.png")
    rows = [{"id": c, "image": str(tmp_path / f"{c}.png"), "prompt": QUESTION,
             "choices_to_score": ["Yes", "No"], "score_text": f"It is {c}.", "score_only": True}
            for c in colours]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    batched = _run(job, tmp_path / "a.parquet", "--model", str(sensitive_vlm))
    alone = _run(
        job, tmp_path / "b.parquet", "--model", str(sensitive_vlm), "--batch-size", "1", "--no-cache"
    )
    model, processor = mlx_vlm.load(str(sensitive_vlm))
    tokenizer = processor.tokenizer
    eos = set(tokenizer.stopping_criteria.eos_token_ids) | {tokenizer.eos_token_id}
    prompt = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    for c in colours:
        image = Image.open(tmp_path / f"{c}.png").convert("RGB")
        slot = getattr(model.config, "image_token_index", None)
        inputs = prepare_inputs(processor, images=[image], prompts=prompt, image_token_index=slot)
        ids = inputs["input_ids"][0].tolist()
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        for got in (batched, alone):
            r = got[c]
            answers = [*[s["choice"] for s in r["choice_scores"]], f"It is {c}."]
            totals = [*[s["logprob"] for s in r["choice_scores"]], r["score_logprob"]]
            for answer, total in zip(answers, totals, strict=True):
                a = answer_ids(tokenizer, answer, eos)
                out = model(mx.array([ids + a]), inputs["pixel_values"], mask=None, **extra)
                assert abs(total - _reference(out.logits, len(ids), a)) < 1e-4, (c, answer)
    assert batched["red"]["choice_scores"] != batched["blue"]["choice_scores"]  # the image matters


@pytest.mark.parametrize("family", ["llava", "smolvlm"])
def test_offset_families_score_and_give_logprobs_alike_on_and_off_the_batch(
    tmp_path, offset_families, family
):
    for c in ("red", "blue", "green"):
        Image.new("RGB", (64, 64), c).save(tmp_path / f"{c}.png")
    asks = {"prompt": QUESTION, "choices_to_score": ["Yes", "No"], "score_text": "A plain colour.",
            "top_logprobs": 3, "max_tokens": 4}  # fmt: skip
    rows = [{"id": c, "image": str(tmp_path / f"{c}.png"), **asks} for c in ("red", "blue", "green")]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    model = ("--model", str(offset_families[family]), "--temperature", "0")
    batched = _run(job, tmp_path / "a.parquet", *model)
    alone = _run(job, tmp_path / "b.parquet", *model, "--batch-size", "1", "--no-cache")
    for c in ("red", "blue", "green"):
        a, b = batched[c], alone[c]
        assert abs(sum(s["prob"] for s in a["choice_scores"]) - 1) < 1e-6
        for x, y in zip(a["choice_scores"], b["choice_scores"], strict=True):
            assert abs(x["logprob"] - y["logprob"]) < 1e-4
        assert abs(a["score_logprob"] - b["score_logprob"]) < 1e-4
        assert [t["id"] for t in a["logprobs"]] == [t["id"] for t in b["logprobs"]]
        assert all(
            abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
        )
    assert batched["red"]["choice_scores"] != batched["blue"]["choice_scores"]

"""--kv-bits: text rows batch on caches quantized where mlx-lm's generate quantizes them, token
for token what mlx-lm's one-row quantized generate makes, at any width; their scores are the
engine's own quantized logprobs; media rows go through mlx-vlm's own quantized generate. On
checkpoints whose output the quantization changes; refused by name where a model cannot take it."""

from __future__ import annotations

import pytest
from conftest import MEDIA, MODELS, read, run_cli, write_jsonl
from PIL import Image, ImageOps

from batchgen.generate.lanes.scoring import answer_ids
from batchgen.tools.tiny.builder import make_tiny_model

LONG = "Tell me a long story about " + "a dragon and a knight " * 8  # 117 prompt tokens
PROMPTS = ["Describe a red circle on a white background in detail.", "Count to ten: one two three", "Hi",
           LONG, "Name three colours of the rainbow, then three more."]  # fmt: skip
QUESTION = "Describe the image."
PICTURES = {"img": "red_circle.png", "img2": "blue_square.webp", "img3": "green_triangle_rotated.jpg"}
KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
MAX_TOKENS = 32  # within which the 8-bit cache parts from the full one on t0 and img
CHOICES = ["yes", "no", "perhaps not"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A sensitive text model and a sensitive qwen2_vl with 32-dim heads (the tiny VLM's 16 are
    smaller than any group MLX quantizes in)."""
    root = tmp_path_factory.mktemp("kv")
    return {
        "lm": make_tiny_model(root / "lm", "lm", sensitive=True),
        "vlm": make_tiny_model(root / "vlm", "vlm", hidden=128, sensitive=True),
    }


def _prompt(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def _lm_reference(model_dir, prompt, max_tokens=MAX_TOKENS, **kv):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    ids = _prompt(tokenizer, prompt)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **kv)]
    said = tokens[:-1] if tokens[-1] in tokenizer.eos_token_ids else tokens
    return tokenizer.decode(said), len(tokens)


def _forced(model_dir, prompt, answer, **kv):
    """An answer's total log-probability through mlx-lm's own generate loop, its sampler made
    to pick the answer's tokens: the engine's quantized cache, token by token."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm.load(str(model_dir))
    tokenizer.add_eos_token("<|im_end|>")
    ids = answer_ids(tokenizer, answer, set(tokenizer.eos_token_ids))
    picks = iter(ids)
    steps = generate_step(
        mx.array(_prompt(tokenizer, prompt)),
        model,
        max_tokens=len(ids),
        sampler=lambda lp: mx.array([next(picks, 0)]),
        **kv,
    )
    return sum(logprobs[token].item() for (token, logprobs), _ in zip(steps, ids, strict=False)), len(ids)


def _vlm_reference(model_dir, image, **kv):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(model_dir))
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{slot}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    ref = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=MAX_TOKENS, temperature=0.0,
                           **kv)  # fmt: skip
    tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    return processor.tokenizer.decode(tokens), len(ref.token_ids)


def _run(tmp_path, models, name, *flags, rows=None):
    if rows is None:
        rows = [{"id": f"t{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
        rows += [
            {"id": name, "image": str(MEDIA / picture), "prompt": QUESTION}
            for name, picture in PICTURES.items()
        ]
        rows.append({"id": "score", "prompt": "Yes or no?", "choices_to_score": CHOICES})
    job = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(models["vlm"]),
                           "--text-model", str(models["lm"]), "--temperature", "0",
                           "--max-tokens", str(MAX_TOKENS), "-q", *flags)  # fmt: skip
    return code, output, {r["id"]: r for r in read(out)} if out.exists() else {}


@pytest.mark.slow  # every row against mlx-lm's quantized generate (5 s)
def test_kv_bits_8_batches_text_rows_as_the_engines_own_quantized_generate(tmp_path, models):
    flags = ("--kv-bits", "8", "--kv-group-size", "32")
    code, output, rows = _run(tmp_path, models, "kv8", *flags)
    assert code == 0, output
    texts = [f"t{i}" for i in range(len(PROMPTS))]
    want = {f"t{i}": _lm_reference(models["lm"], p, **KV) for i, p in enumerate(PROMPTS)}
    for name, picture in PICTURES.items():
        upright = ImageOps.exif_transpose(Image.open(MEDIA / picture)).convert("RGB")  # as batchgen reads it
        want[name] = _vlm_reference(models["vlm"], upright, **KV)
    got = {i: (rows[i]["generated_text"], rows[i]["completion_tokens"]) for i in want}
    assert got == want
    assert "one at a time" not in output  # text rows, picture rows and the score row all batched
    # One at a time on the batched lane, the same tokens: what a row draws does not depend on its batch.
    code, alone, single = _run(tmp_path, models, "kv8-1", *flags, "--batch-size", "1")
    assert code == 0 and all(single[i]["generated_text"] == rows[i]["generated_text"] for i in texts)
    # The setting reached the engines: their full-precision cache says something else.
    plain = {f"t{i}": _lm_reference(models["lm"], p) for i, p in enumerate(PROMPTS)}
    plain["img"] = _vlm_reference(models["vlm"], Image.open(MEDIA / "red_circle.png").convert("RGB"))
    assert plain["t0"] != want["t0"] and plain["t3"] != want["t3"] and plain["img"] != want["img"]
    # Scores on the quantized cache: mlx-lm's own logprobs, its sampler made to pick each answer.
    scores = rows["score"]["choice_scores"]
    assert rows["score"]["status"] == "ok" and [c["choice"] for c in scores] == CHOICES
    for c in scores:
        total, n = _forced(models["lm"], "Yes or no?", c["choice"], **KV)
        full, _ = _forced(models["lm"], "Yes or no?", c["choice"])
        assert abs(c["logprob"] - total) < 1e-3 and c["tokens"] == n, (c, total)
        assert abs(full - total) > 1e-3  # the quantization shows in the scores too
    # A rerun under another cache quantization would mix outputs: refused, naming it.
    code, again, _ = _run(tmp_path, models, "kv8", "--kv-bits", "4", "--kv-group-size", "32")
    assert code == 2 and "kv_cache: [8, 32, 0] then, [4, 32, 0] now" in again


def test_quantized_kv_start_sends_each_row_where_mlx_lm_quantizes_its_cache(tmp_path, models):
    """--quantized-kv-start 40: a 117-token prompt is quantized before its last token (batched,
    quantized), a short row that ends before 40 tokens never is (the full-precision lane), one
    that reaches 40 while it decodes runs alone through mlx-lm's own generate; each is what that
    generate makes."""
    start = {**KV, "quantized_kv_start": 40}
    rows = [
        {"id": "long", "prompt": LONG},
        {"id": "long2", "prompt": LONG + " Again."},
        {"id": "short", "prompt": "Hi", "max_tokens": 8},
        {"id": "crosses", "prompt": PROMPTS[0]},
    ]
    code, output, got = _run(
        tmp_path,
        models,
        "start",
        "--kv-bits",
        "8",
        "--kv-group-size",
        "32",
        "--quantized-kv-start",
        "40",
        rows=rows,
    )
    assert code == 0, output
    for row in rows:
        want = _lm_reference(models["lm"], row["prompt"], row.get("max_tokens", MAX_TOKENS), **start)
        assert (got[row["id"]]["generated_text"], got[row["id"]]["completion_tokens"]) == want, row["id"]
    why = "--kv-bits 8: rows whose cache is quantized while they decode (--quantized-kv-start 40)"
    assert f"1 row one at a time ({why})" in output
    plain = _lm_reference(models["lm"], PROMPTS[0])  # its cache quantized at 40 tokens changes its answer
    assert plain != (got["crosses"]["generated_text"], got["crosses"]["completion_tokens"])


def test_a_group_size_the_heads_cannot_take_stops_the_run_before_work(tmp_path, models):
    code, output, rows = _run(tmp_path, models, "g64", "--kv-bits", "8")
    assert code == 2 and not rows
    assert f"--kv-group-size 64: model {str(models['vlm'])!r} has 32-dim attention heads" in output
    assert "(--kv-group-size 32 does)" in output
    job = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "Hi"}])
    code, output = run_cli("run", str(job), "-o", str(tmp_path / "one.parquet"), "--model",
                           str(MODELS / "tiny-vlm"), "--kv-bits", "4", "--kv-group-size", "32")  # fmt: skip
    assert code == 2 and "has 16-dim attention heads" in output and "no MLX group size does" in output
    bad = {("--kv-bits", "7"): "--kv-bits 7: expected one of 2, 3, 4, 5, 6, 8",
           ("--kv-bits", "8", "--kv-group-size", "16"): "--kv-group-size 16: expected 32, 64"}  # fmt: skip
    for flags, message in bad.items():
        code, output, _ = _run(tmp_path, models, "bad", *flags)
        assert code == 2 and message in output


def test_the_memory_budget_measures_a_quantized_row_on_the_quantized_cache():
    """An 8-bit cache in groups of 32 on tiny-lm (float32, 32-wide heads) holds a value in one
    byte and a float32 scale and bias per 32: 1.25 bytes against 4, so 5/16 of a row."""
    from batchgen.generate.decode.batch_cache import KVQuant
    from batchgen.generate.router import Router

    router = Router(str(MODELS / "tiny-lm"), memory_budget="4GB", kv=KVQuant(8, 32, 0))
    full, quantized = router.text.footprint(), router.text_kv.footprint()
    assert full is not None and quantized is not None
    assert quantized.per_token * 16 == full.per_token * 5


def _run_on(model_dir, job, out, *flags):
    """`batchgen run` of `job` on one model with the tests' 8-bit cache in groups of 32."""
    return run_cli(
        "run",
        str(job),
        "-o",
        str(out),
        "--model",
        str(model_dir),
        "--kv-bits",
        "8",
        "--kv-group-size",
        "32",
        "-q",
        *flags,
    )


@pytest.mark.parametrize("kind", ["llava", "smolvlm"])
def test_kv_bits_batches_image_rows_of_the_offset_families_as_mlx_vlm(tmp_path, kind):
    """Six image rows (three pictures, two questions each) of a cache-offset family with 32-dim
    heads, batched on quantized caches: each as mlx-vlm's own quantized generate makes it."""
    import mlx_vlm
    import numpy as np
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.generate.load.loading import mend_processor

    model_dir = make_tiny_model(tmp_path / kind, kind, sensitive=True, hidden=128)
    rng = np.random.default_rng(3)
    for k in range(3):
        Image.fromarray(rng.integers(0, 256, (40 + 8 * k, 48, 3), dtype=np.uint8)).save(
            tmp_path / f"p{k}.png"
        )
    questions = ["Describe the image.", "What is in it?"]
    rows = [
        {"id": f"r{n}", "image": f"p{n % 3}.png", "prompt": questions[n // 3], "max_tokens": 12 + n}
        for n in range(6)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = _run_on(model_dir, job, out, "--temperature", "0")
    assert code == 0 and "one at a time" not in output, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)
    tokenizer = getattr(processor, "tokenizer", processor)
    changed = 0
    for row in rows:
        text = row["prompt"]
        turns = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text, "content": text}]}
        ]
        prompt = get_chat_template(processor, turns, True)
        picture = [Image.open(tmp_path / row["image"]).convert("RGB")]
        ref = mlx_vlm.generate(
            model, processor, prompt, image=picture, max_tokens=row["max_tokens"], temperature=0.0, **KV
        )
        said = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
        assert got[row["id"]] == (tokenizer.decode(said), len(ref.token_ids)), row["id"]
        plain = mlx_vlm.generate(
            model, processor, prompt, image=picture, max_tokens=row["max_tokens"], temperature=0.0
        )
        changed += plain.token_ids != ref.token_ids
    assert changed or kind == "llava"  # smolvlm's answers move with the 8-bit cache


def test_kv_bits_on_a_model_with_sliding_window_layers_stops_the_run_naming_why(tmp_path):
    model_dir = make_tiny_model(tmp_path / "gemma3", "gemma3", hidden=128)
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": "Yo"}])
    out = tmp_path / "out.parquet"
    code, output = _run_on(model_dir, job, out)
    assert code == 2 and "keeps a cache MLX cannot quantize" in output and "without --kv-bits" in output
    assert not out.exists()

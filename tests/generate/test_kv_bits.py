"""--kv-bits: the engines' own quantized KV cache, token for token what mlx-lm's and mlx-vlm's
one-row generate make with the same setting, on checkpoints whose output the quantization
changes; refused by name where a lane or a model cannot take it."""

from __future__ import annotations

import pytest
from conftest import MEDIA, MODELS, read, run_cli, write_jsonl
from PIL import Image

from batchgen.tools.tiny.builder import make_tiny_model

PROMPTS = ["Describe a red circle on a white background in detail.", "Count to ten: one two three"]
QUESTION = "Describe the image."
KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
MAX_TOKENS = 32  # within which the 8-bit cache parts from the full one on t0 and img


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A sensitive text model and a sensitive qwen2_vl with 32-dim heads (the tiny VLM's 16 are
    smaller than any group MLX quantizes in)."""
    root = tmp_path_factory.mktemp("kv")
    return {
        "lm": make_tiny_model(root / "lm", "lm", sensitive=True),
        "vlm": make_tiny_model(root / "vlm", "vlm", hidden=128, sensitive=True),
    }


def _lm_reference(model_dir, prompt, **kv):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, **kv)]
    said = tokens[:-1] if tokens[-1] in tokenizer.eos_token_ids else tokens
    return tokenizer.decode(said), len(tokens)


def _vlm_reference(model_dir, image, **kv):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(model_dir))
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{slot}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    ref = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=MAX_TOKENS, temperature=0.0,
                           **kv)  # fmt: skip
    tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    return processor.tokenizer.decode(tokens), len(ref.token_ids)


def _run(tmp_path, models, name, *flags):
    rows = [{"id": f"t{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.append({"id": "img", "image": str(MEDIA / "red_circle.png"), "prompt": QUESTION})
    rows.append({"id": "score", "prompt": "Yes or no?", "choices_to_score": ["yes", "no"]})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(models["vlm"]),
                           "--text-model", str(models["lm"]), "--temperature", "0",
                           "--max-tokens", str(MAX_TOKENS), "-q", *flags)  # fmt: skip
    return code, output, {r["id"]: r for r in read(out)} if out.exists() else {}


def test_kv_bits_8_is_the_engines_own_quantized_generate(tmp_path, models):
    flags = ("--kv-bits", "8", "--kv-group-size", "32")
    code, output, rows = _run(tmp_path, models, "kv8", *flags)
    assert code == 1, output  # the score row: scores need a batched lane
    got = {i: (rows[i]["generated_text"], rows[i]["completion_tokens"]) for i in ("t0", "t1", "img")}
    want = {f"t{i}": _lm_reference(models["lm"], p, **KV) for i, p in enumerate(PROMPTS)}
    want["img"] = _vlm_reference(models["vlm"], Image.open(MEDIA / "red_circle.png").convert("RGB"), **KV)
    assert got == want
    assert all(rows[i]["status"] == "ok" for i in ("t0", "t1", "img"))
    # The setting reached the engines: their full-precision cache says something else.
    plain = {f"t{i}": _lm_reference(models["lm"], p) for i, p in enumerate(PROMPTS)}
    plain["img"] = _vlm_reference(models["vlm"], Image.open(MEDIA / "red_circle.png").convert("RGB"))
    assert plain["t0"] != want["t0"] and plain["img"] != want["img"]
    assert rows["score"]["status"] == "error"
    assert "scores need a batched lane; this row runs one at a time (--kv-bits 8)" in rows["score"]["error"]
    assert "4 rows one at a time (--kv-bits 8: quantized KV caches do not batch)" in output
    # A rerun under another cache quantization would mix outputs: refused, naming it.
    code, again, _ = _run(tmp_path, models, "kv8", "--kv-bits", "4", "--kv-group-size", "32")
    assert code == 2 and "kv_cache: [8, 32, 0] then, [4, 32, 0] now" in again


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

"""Prefix reuse and batching change the speed, never the greedy output."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from conftest import MODELS, batch, read, write_jsonl
from PIL import Image

SYSTEM = "You are a careful assistant that answers in one short sentence. " * 6


def _shared_image_job(workdir, images: int = 3, questions: int = 3):
    rng = np.random.default_rng(1)
    rows = []
    for i in range(images):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(workdir / f"im{i}.png")
    for q in range(questions):  # interleaved: the scheduler must bring each image's rows together
        for i in range(images):
            rows.append(
                {"id": f"i{i}q{q}", "image": f"im{i}.png", "system": SYSTEM, "prompt": f"Question {q}?"}
            )
    rows += [{"id": f"t{k}", "system": SYSTEM, "prompt": f"Text question {k}."} for k in range(4)]
    rows.append({"id": "plain", "prompt": "No system prompt here."})
    return write_jsonl(workdir / "jobs.jsonl", rows)


def _outputs(path):
    return [(r["id"], r["generated_text"], r["completion_tokens"], r["finish_reason"]) for r in read(path)]


@pytest.mark.slow  # every switch of reuse and batching (3 s)
def test_greedy_output_is_identical_with_cache_and_batching_on_or_off(workdir):
    job = _shared_image_job(workdir)
    runs = {
        "default": (),
        "no-cache": ("--no-cache",),
        "no-batch": ("--batch-size", "1"),
        "neither": ("--no-cache", "--batch-size", "1"),
    }
    outputs = {}
    for name, flags in runs.items():
        code, output = batch(job, workdir / f"{name}.parquet", "--max-tokens", "12", *flags)
        assert code == 0, output
        outputs[name] = _outputs(workdir / f"{name}.parquet")
    assert outputs["default"] == outputs["no-cache"] == outputs["no-batch"] == outputs["neither"]
    rows = {r["id"]: r for r in read(workdir / "default.parquet")}
    # Every image's second and third question reuse the image prefix; the first ones reuse the
    # system prompt that an earlier image already paid for.
    first = {r["id"]: r for r in read(workdir / "neither.parquet")}
    assert all(first[k]["cached_tokens"] == 0 for k in first)
    for i in range(3):
        assert rows[f"i{i}q1"]["cached_tokens"] > rows[f"i{i}q0"]["cached_tokens"]
    assert rows["i1q0"]["cached_tokens"] > 0 and rows["t1"]["cached_tokens"] > 0
    stats = json.loads((workdir / "default.parquet.stats.json").read_text())
    assert stats["cache"]["prefix_hits"] >= 11 and stats["cache"]["prompt_tokens_saved"] > 0
    assert stats["cached_tokens"] == sum(r["cached_tokens"] for r in rows.values())


def test_output_matches_the_engines_own_generate(workdir):
    """The decoder's greedy tokens are what mlx-vlm and mlx-lm produce one row at a time."""
    import mlx_lm
    import mlx_vlm

    job = _shared_image_job(workdir, images=2, questions=2)
    assert batch(job, workdir / "out.parquet", "--max-tokens", "10")[0] == 0
    rows = {r["id"]: r for r in read(workdir / "out.parquet")}

    model, processor = mlx_vlm.load(str(MODELS / "tiny-vlm"))
    for i in range(2):
        for q in range(2):
            prompt = (
                f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
                f"<|vision_start|><|image_pad|><|vision_end|>Question {q}?<|im_end|>\n<|im_start|>assistant\n"
            )
            image = Image.open(workdir / f"im{i}.png").convert("RGB")
            ref = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=10, temperature=0.0)
            tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
            assert rows[f"i{i}q{q}"]["generated_text"] == processor.tokenizer.decode(tokens)
            assert rows[f"i{i}q{q}"]["completion_tokens"] == len(ref.token_ids)
    lm, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    tokenizer.add_eos_token("<|im_end|>")
    for k in range(4):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Text question {k}."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        tokens = [r.token for r in mlx_lm.stream_generate(lm, tokenizer, ids, max_tokens=10)]
        if tokens[-1] in tokenizer.eos_token_ids:
            tokens = tokens[:-1]
        assert rows[f"t{k}"]["generated_text"] == tokenizer.decode(tokens)


def test_distinct_images_and_images_with_identical_byte_prefixes_never_share(workdir):
    # Two PNGs identical in their first rows (and so in their first bytes), different below.
    base = np.zeros((56, 56, 3), np.uint8)
    other = base.copy()
    other[40:] = 255
    blobs = []
    for i, pixels in enumerate((base, other)):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=0)
        (workdir / f"p{i}.png").write_bytes(buf.getvalue())
        blobs.append(buf.getvalue())
    assert blobs[0][:200] == blobs[1][:200] and blobs[0] != blobs[1]
    job = write_jsonl(workdir / "jobs.jsonl", [
        {"id": "a", "image": "p0.png", "prompt": "Same question?"},
        {"id": "b", "image": "p1.png", "prompt": "Same question?"},
    ])  # fmt: skip
    assert batch(job, workdir / "out.parquet")[0] == 0
    a, b = read(workdir / "out.parquet")
    # Only "<|im_start|>user\n" before the image is shared, never the image itself.
    assert a["cached_tokens"] == 0 and b["cached_tokens"] == 3
    stats = json.loads((workdir / "out.parquet.stats.json").read_text())["cache"]
    assert stats["prefix_hits"] == 1 and stats["prompt_tokens_saved"] == 3


def test_image_processor_output_is_reused_for_the_same_image_and_handed_out_as_copies():
    from batchgen.core.records import IMAGE_DIGEST
    from batchgen.generate.load.loading import SharedImages

    calls = []

    def inner(images, **kwargs):
        calls.append((len(images), kwargs))
        return {"pixel_values": np.ones((len(images), 3, 4, 4)) * len(calls), "num_crops": [0] * len(images)}

    shared = SharedImages(inner)
    a, b = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    first = shared([a], do_pad=True)
    first.pop("num_crops")  # gemma3's processor pops keys from what it gets
    first["pixel_values"] *= 0
    again = shared([a], do_pad=True)
    assert len(calls) == 1 and again["num_crops"] == [0] and again["pixel_values"].max() == 1
    shared([a], do_pad=False)  # other settings
    shared(images=[b], do_pad=True)  # other pixels
    shared([[a, b]], do_pad=True)  # nested, as batched processors pass them
    assert len(calls) == 4
    shared([Image.new("RGB", (4, 4), "red")], do_pad=True)  # another object with a's pixels: its content
    assert len(calls) == 4
    shared(images=[Image.new("RGB", (4, 4), "blue")], do_pad=True)  # by keyword too (Qwen's processors)
    assert len(calls) == 4
    tagged = Image.new("RGB", (4, 4), "blue")
    tagged.info[IMAGE_DIGEST] = "d1"  # decoded by the media stage: its digest is its key
    shared([tagged], do_pad=True)
    retagged = Image.new("RGB", (4, 4), "green")
    retagged.info[IMAGE_DIGEST] = "d1"
    assert len(calls) == 5 and shared([retagged], do_pad=True)["pixel_values"].max() == 5
    shared([np.zeros((4, 4, 3))], do_pad=True)  # arrays can change in place: never kept
    shared([np.zeros((4, 4, 3))], do_pad=True)
    assert len(calls) == 7


def test_kept_image_processor_outputs_are_bounded_by_their_bytes():
    from batchgen.generate.load.loading import SHARED_IMAGE_BYTES, SharedImages

    calls = []
    side = int((SHARED_IMAGE_BYTES / 8 / 2.5) ** 0.5)  # two such outputs (float64) fit, not three
    shared = SharedImages(lambda images: calls.append(1) or {"pixel_values": np.zeros((1, side, side))})
    big = [Image.new("RGB", (2, 2), colour) for colour in ("red", "green", "blue")]
    for im in big:
        shared([im])
    shared([big[2]])
    shared([big[1]])
    assert len(calls) == 3 and len(shared.memo) == 2
    shared([big[0]])  # the oldest went
    assert len(calls) == 4

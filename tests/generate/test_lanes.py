"""The lanes against the engines' own generate, on a checkpoint whose output changes with
every image, its order and its position: images follow their slots, penalties follow one
rule, rows joining a running batch and video rows keep their own positions."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MEDIA, read, run_cli, write_jsonl
from PIL import Image

pytestmark = pytest.mark.slow  # every family, token for token against mlx-vlm

QUESTION = "What is in these pictures?"


def _reference(model_dir, images, max_tokens=10):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(model_dir))
    slots = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
    prompt = f"<|im_start|>user\n{slots}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    ref = mlx_vlm.generate(model, processor, prompt, image=images, max_tokens=max_tokens, temperature=0.0)
    return _text(processor, ref), len(ref.token_ids)


def _text(processor, ref):
    tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    return processor.tokenizer.decode(tokens)


def _parts(text):
    """A text as the one part of a message, as batchgen hands it to a chat template (both keys)."""
    return [{"type": "text", "text": text, "content": text}]


def _on_and_off(job, model_dir, *flags):
    """Greedy outputs by id, (text, completion tokens), with cache and batching on (and
    `flags`) and with both off, checked equal; and the cached tokens of the first run."""
    outputs, cached = {}, {}
    for name, more in {"default": flags, "neither": ("--batch-size", "1", "--no-cache")}.items():
        out = job.with_name(f"{name}.parquet")
        code, output = run_cli("run", str(job), "-o", str(out), "--model", str(model_dir),
                               "--temperature", "0", "-q", *more)  # fmt: skip
        assert code == 0, output
        rows = read(out)
        outputs[name] = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in rows}
        cached = cached or {r["id"]: r["cached_tokens"] for r in rows}
    assert outputs["default"] == outputs["neither"]
    return outputs, cached


def test_a_flat_image_and_an_image_in_messages_reach_their_own_slots(tmp_path, sensitive_vlm):
    rng = np.random.default_rng(5)
    for name, shape in (("a", (56, 56, 3)), ("b", (40, 72, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(tmp_path / f"{name}.png")

    def user(*images):
        return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip

    job = write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": "flat-first", "image": "a.png", "messages": user("b.png")},
        {"id": "explicit", "messages": user("a.png", "b.png")},
        {"id": "reversed", "messages": user("b.png", "a.png")},
    ])  # fmt: skip
    pictures = [Image.open(tmp_path / f"{n}.png").convert("RGB") for n in "ab"]
    in_order, swapped = _reference(sensitive_vlm, pictures), _reference(sensitive_vlm, pictures[::-1])
    assert in_order != swapped  # the checkpoint tells the orders apart
    for flags in ((), ("--batch-size", "1", "--no-cache")):
        out = tmp_path / f"out{len(flags)}.parquet"
        code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_vlm),
                               "--temperature", "0", "--max-tokens", "10", "-q", *flags)  # fmt: skip
        assert code == 0, output
        got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
        assert got == {"flat-first": in_order, "explicit": in_order, "reversed": swapped}


def test_penalties_see_the_prompt_then_the_completion_on_every_lane(tmp_path, sensitive_vlm):
    """One rule (mlx-lm's): logits processors see the prompt, then the tokens generated. The
    batched lanes and the one-row mlx-vlm lane agree, and mlx-lm's own generate agrees."""
    import mlx_lm
    import mlx_vlm
    from conftest import MODELS
    from mlx_lm.sample_utils import make_logits_processors

    from batchgen.core.params import GenParams
    from batchgen.core.records import Media, MediaItem
    from batchgen.generate.base.watch import Watch
    from batchgen.generate.lanes.one_row import generate_vlm
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow

    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    penalties = {"repetition_penalty": 1.6, "presence_penalty": 0.8, "max_tokens": 12}
    rows = [
        {"id": f"i{k}", "image": "a.png", "prompt": f"Question {k}: what is it?", **penalties}
        for k in range(3)
    ]
    rows += [{"id": f"t{k}", "prompt": f"Say something about {k} {k} {k}.", **penalties} for k in range(3)]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_vlm), "--text-model",
                           str(MODELS / "tiny-lm"), "--temperature", "0", "-q")  # fmt: skip
    assert code == 0, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}

    model, processor = mlx_vlm.load(str(sensitive_vlm))
    image = Image.open(tmp_path / "a.png").convert("RGB")
    differs = 0
    for k in range(3):
        parsed, _ = parse_row(RawRow(k, k + 1, rows[k]), GenParams(temperature=0.0), None)
        single = generate_vlm(
            model, processor, parsed, Media([MediaItem("image", image, "a")]), watch=Watch()
        )
        assert got[f"i{k}"] == (single.text, single.completion_tokens)
        prompt = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Question {k}: what is it?<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501
        own = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0,
                               repetition_penalty=1.6, presence_penalty=0.8)  # fmt: skip
        differs += _text(processor, own) != single.text
    assert differs  # mlx-vlm's own rule (the last prompt token only) gives other tokens here
    lm, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    tokenizer.add_eos_token("<|im_end|>")
    for k in range(3):
        messages = [{"role": "user", "content": f"Say something about {k} {k} {k}."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        procs = make_logits_processors(repetition_penalty=1.6, presence_penalty=0.8)
        tokens = [
            r.token
            for r in mlx_lm.stream_generate(lm, tokenizer, ids, max_tokens=12, logits_processors=procs)
        ]
        plain = [r.token for r in mlx_lm.stream_generate(lm, tokenizer, ids, max_tokens=12)]
        assert tokens != plain  # the penalties matter on this checkpoint
        count = len(tokens)
        if tokens[-1] in tokenizer.eos_token_ids:
            tokens = tokens[:-1]
        assert got[f"t{k}"] == (tokenizer.decode(tokens), count)


def test_vision_rows_joining_a_running_batch_keep_their_own_positions(tmp_path, sensitive_vlm):
    """Rows of different images and budgets refill two slots as others finish (mRoPE positions
    per row); each row's greedy output is mlx-vlm's for that row alone."""
    rng = np.random.default_rng(11)
    sizes = [(56, 56, 3), (40, 72, 3), (64, 48, 3)]
    for k, shape in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(tmp_path / f"p{k}.png")
    budgets = [1, 14, 3, 9, 2, 12]
    rows = [
        {"id": f"r{n}", "image": f"p{n % 3}.png", "prompt": QUESTION, "max_tokens": m}
        for n, m in enumerate(budgets)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_vlm),
                           "--temperature", "0", "--batch-size", "2", "-q")  # fmt: skip
    assert code == 0, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    pictures = [Image.open(tmp_path / f"p{k}.png").convert("RGB") for k in range(3)]
    want = {f"r{n}": _reference(sensitive_vlm, [pictures[n % 3]], m) for n, m in enumerate(budgets)}
    assert got == want


@pytest.mark.parametrize(
    "family",
    [
        "sensitive_vlm",
        "sensitive_qwen2_5",
        "sensitive_qwen3_5",
        "sensitive_qwen3_vl",
        "sensitive_qwen3_vl_moe",
    ],
)
def test_video_rows_batch_share_the_clip_and_match_mlx_vlm(workdir, request, family):
    """Several questions per clip (the captioning pattern) on the batched lane: the clip's
    prefix is computed once, and each row's greedy output is mlx-vlm's for that row alone."""
    sensitive_vlm = request.getfixturevalue(family)
    import threading

    import mlx_vlm

    from batchgen.core.params import GenParams
    from batchgen.core.settings import MediaConfig
    from batchgen.generate.base.models import inspect_model
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow
    from batchgen.media.resolve import MediaStage

    questions = ["What moves?", "Which way does it go?", "Describe the clip in detail.", "Colour?"]
    rows = [
        {"id": f"v{k}", "video": "media/moving_dot.mp4", "prompt": q, "max_tokens": 6 + 3 * k}
        for k, q in enumerate(questions)
    ]
    rows.append({"id": "img", "image": "media/red_circle.png", "prompt": questions[0]})
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    outputs, cached = _on_and_off(job, sensitive_vlm)
    first, *rest = sorted(cached[f"v{k}"] for k in range(4))  # the longest budget runs first
    assert len(set(rest)) == 1 and rest[0] > first + 4  # the clip, once

    info = inspect_model(str(sensitive_vlm))
    stage = MediaStage(MediaConfig(), workdir, workdir, False, info.max_pixels, threading.Event())
    parsed, _ = parse_row(RawRow(0, 1, rows[0]), GenParams(), None)
    frames = stage.resolve(parsed).media.videos[0]
    model, processor = mlx_vlm.load(str(sensitive_vlm))
    for k, q in enumerate(questions):
        clip = "<|vision_start|><|video_pad|><|vision_end|>"
        prompt = f"<|im_start|>user\n{clip}{q}<|im_end|>\n<|im_start|>assistant\n"
        ref = mlx_vlm.generate(
            model, processor, prompt, video=[frames], max_tokens=6 + 3 * k, temperature=0.0
        )
        assert outputs["default"][f"v{k}"] == (_text(processor, ref), len(ref.token_ids))


OFFSET_FAMILIES = [
    "llava",
    "llava_next",
    "smolvlm",
    "idefics3",
    "gemma3",
    "gemma4",
    "mistral3",
    "internvl_chat",
]


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
def test_offset_family_rows_batch_and_match_mlx_vlm(tmp_path, offset_families, family):
    """llava and LLaVA-NeXT (their processors mended for transformers 5), SmolVLM, Idefics3,
    Gemma 3, Gemma 4 (per-layer inputs), Mistral 3 and InternVL on the offset-positioned
    batched lane: a shared image under different system prompts, other images, mixed budgets,
    slots refilled; the same with cache and batching off; each row as mlx-vlm generates it."""
    model_dir = offset_families[family]
    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.generate.load.loading import mend_processor

    rng = np.random.default_rng(3)
    for k in range(3):
        Image.fromarray(rng.integers(0, 256, (40 + 8 * k, 48, 3), dtype=np.uint8)).save(
            tmp_path / f"p{k}.png"
        )
    systems = ["You describe pictures.", "You are terse.", None]
    rows = []
    for n in range(9):
        row = {"id": f"r{n}", "image": f"p{n % 3}.png", "prompt": QUESTION, "max_tokens": 2 + 3 * (n % 4)}
        if systems[n // 3]:
            row["system"] = systems[n // 3]
        rows.append(row)
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    outputs, cached = _on_and_off(job, model_dir, "--batch-size", "3")
    assert sum(c > 0 for c in cached.values()) >= 4  # system prompts and images shared

    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)
    pictures = [Image.open(tmp_path / f"p{k}.png").convert("RGB") for k in range(3)]
    texts = set()
    for n, row in enumerate(rows):
        # The prompt as the checkpoint's processor renders it (mlx-vlm's InternVL processor
        # brings its own template); media first, as batchgen puts them.
        user = [{"type": "image"}, *_parts(QUESTION)]
        turns = ([{"role": "system", "content": _parts(row["system"])}] if "system" in row else []) + [
            {"role": "user", "content": user}
        ]
        prompt = get_chat_template(processor, turns, True)
        budget = row["max_tokens"]
        ref = mlx_vlm.generate(
            model, processor, prompt, image=[pictures[n % 3]], max_tokens=budget, temperature=0.0
        )
        assert outputs["default"][row["id"]] == (_text(processor, ref), len(ref.token_ids))
        texts.add(_text(processor, ref))
    assert len(texts) >= 7  # outputs vary per row and per image: a position bug would show


@pytest.mark.parametrize("family", ["smolvlm", "mistral3", "llava"])
def test_video_rows_of_offset_families_batch_as_frames_and_match_mlx_vlm(workdir, offset_families, family):
    """A family without a video token takes a clip's sampled frames as images, each in an image
    slot of its own (mlx-vlm once got the frames with no slot: SmolVLM refused the row, Mistral 3
    answered without the video). Questions on one clip batch on the offset lane beside an image
    row, and each equals mlx-vlm's generate given the frames as images with their slots."""
    import threading

    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.core.params import GenParams
    from batchgen.core.settings import MediaConfig
    from batchgen.generate.base.models import inspect_model
    from batchgen.generate.load.loading import mend_processor
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow
    from batchgen.media.resolve import MediaStage

    model_dir = offset_families[family]
    questions = ["What moves?", "Which way does it go?", "Describe the clip."]
    rows = [{"id": f"v{k}", "video": "media/moving_dot.mp4", "prompt": q, "max_tokens": 5 + 3 * k}
            for k, q in enumerate(questions)]  # fmt: skip
    rows.append({"id": "img", "image": "media/red_circle.png", "prompt": questions[0], "max_tokens": 5})
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(model_dir), "--temperature", "0")
    assert code == 0 and "one at a time" not in output, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    info = inspect_model(str(model_dir))
    stage = MediaStage(MediaConfig(), workdir, workdir, False, info.max_pixels, threading.Event())
    frames = stage.resolve(parse_row(RawRow(0, 1, rows[0]), GenParams(), None)[0]).media.videos[0]
    assert len(frames) > 1
    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)
    pictures = [Image.fromarray(f) for f in frames]
    texts = set()
    for k, q in enumerate(questions):
        turns = [{"role": "user", "content": [{"type": "image"}] * len(frames) + _parts(q)}]
        prompt = get_chat_template(processor, turns, True)
        ref = mlx_vlm.generate(
            model, processor, prompt, image=pictures, max_tokens=5 + 3 * k, temperature=0.0
        )
        assert got[f"v{k}"] == (_text(processor, ref), len(ref.token_ids)), f"v{k}"
        texts.add(got[f"v{k}"][0])
    assert len(texts) > 1


@pytest.mark.parametrize("kind", ["vlm", "llava", "smolvlm", "qwen3_5", "qwen2_5_vl", "qwen3_vl"])
def test_4bit_and_hybrid_checkpoints_batch_and_match_mlx_vlm(tmp_path, request, kind):
    """4-bit checkpoints of three families, Qwen3.5 (linear-attention caches), Qwen2.5-VL and
    Qwen3-VL (DeepStack):
    different images, mixed budgets, two slots refilled; each row as mlx-vlm generates it."""
    import mlx_vlm

    from batchgen.generate.load.loading import mend_processor

    float_ones = {
        "qwen3_5": "sensitive_qwen3_5",
        "qwen2_5_vl": "sensitive_qwen2_5",
        "qwen3_vl": "sensitive_qwen3_vl",
    }
    if kind in float_ones:
        model_dir = request.getfixturevalue(float_ones[kind])
    else:
        model_dir = request.getfixturevalue("quantized")[kind]
    rng = np.random.default_rng(9)
    for k in range(2):
        Image.fromarray(rng.integers(0, 256, (48, 40 + 16 * k, 3), dtype=np.uint8)).save(
            tmp_path / f"q{k}.png"
        )
    rows = [
        {"id": f"r{n}", "image": f"q{n % 2}.png", "prompt": QUESTION, "max_tokens": 3 + 4 * n}
        for n in range(4)
    ]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(model_dir), "--temperature", "0",
                           "--batch-size", "2", "-q")  # fmt: skip
    assert code == 0, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"], r["cached_tokens"]) for r in read(out)}
    for a, b in (("r0", "r2"), ("r1", "r3")):  # each image's second question reuses its prefix
        assert max(got[a][2], got[b][2]) > min(got[a][2], got[b][2])

    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)
    slot = "<image>" if kind in ("llava", "smolvlm") else "<|vision_start|><|image_pad|><|vision_end|>"
    for n, row in enumerate(rows):
        picture = Image.open(tmp_path / f"q{n % 2}.png").convert("RGB")
        prompt = f"<|im_start|>user\n{slot}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        ref = mlx_vlm.generate(
            model, processor, prompt, image=[picture], max_tokens=row["max_tokens"], temperature=0.0
        )
        assert got[row["id"]][:2] == (_text(processor, ref), len(ref.token_ids))


def test_images_beside_a_video_fail_where_the_engine_drops_the_video(workdir):
    """mlx-vlm's Qwen2-VL embeds one kind of media a prompt: a row with images and a video was
    answered without its video (and called ok). Such a row is now its own error, naming why;
    the other rows run."""
    from conftest import MODELS

    rows = [
        {"id": "both", "image": "media/red_circle.png", "video": "media/moving_dot.mp4", "prompt": "Same?"},
        {"id": "both2", "image": "media/blue_square.webp", "video": "media/moving_dot.mp4", "prompt": "And?"},
        {"id": "image", "image": "media/red_circle.png", "prompt": "Shape?"},
    ]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(MODELS / "tiny-vlm"),
                           "--max-tokens", "2")  # fmt: skip
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    for name in ("both", "both2"):
        assert got[name]["error_stage"] == "generate"
        assert "qwen2_vl embeds one kind of media a prompt" in got[name]["error"]
        assert "video would go unseen" in got[name]["error"]
    assert got["image"]["status"] == "ok" and "one at a time" not in output


def test_images_beside_a_video_batch_on_qwen3_vl_and_match_mlx_vlm(workdir, sensitive_qwen3_vl):
    """Qwen3-VL's model embeds both kinds in one prompt: such rows batch beside image and video
    rows, each equal to mlx-vlm's generate given the picture and the sampled frames."""
    import threading

    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.core.params import GenParams
    from batchgen.core.settings import MediaConfig
    from batchgen.generate.base.models import inspect_model
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow
    from batchgen.media.resolve import MediaStage

    def both(picture, question, n):
        content = [{"type": "image", "image": picture}, {"type": "video", "video": "media/moving_dot.mp4"},
                   {"type": "text", "text": question}]  # fmt: skip
        return {"messages": [{"role": "user", "content": content}], "max_tokens": n}

    rows = [
        {"id": "red", **both("media/red_circle.png", "Same?", 10)},
        {"id": "blue", **both("media/blue_square.webp", "Which one moves?", 12)},
        {"id": "image", "image": "media/red_circle.png", "prompt": "Same?", "max_tokens": 8},
        {"id": "video", "video": "media/moving_dot.mp4", "prompt": "Same?", "max_tokens": 8},
    ]
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    out = workdir / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_qwen3_vl),
                           "--temperature", "0")  # fmt: skip
    assert code == 0, output
    assert "one at a time" not in output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    assert len(set(got.values())) == 4  # the picture and the clip both reach the answer

    info = inspect_model(str(sensitive_qwen3_vl))
    stage = MediaStage(MediaConfig(), workdir, workdir, False, info.max_pixels, threading.Event())
    model, processor = mlx_vlm.load(str(sensitive_qwen3_vl))
    for k, row in enumerate(rows[:2]):
        parsed, _ = parse_row(RawRow(k, k + 1, row), GenParams(), None)
        media = stage.resolve(parsed).media
        question = row["messages"][0]["content"][2]["text"]
        parts = [
            {"type": "image"},
            {"type": "video"},
            {"type": "text", "text": question, "content": question},
        ]
        prompt = get_chat_template(processor, [{"role": "user", "content": parts}], True)
        ref = mlx_vlm.generate(model, processor, prompt, image=list(media.images), video=list(media.videos),
                               max_tokens=row["max_tokens"], temperature=0.0)  # fmt: skip
        assert got[row["id"]] == (_text(processor, ref), len(ref.token_ids)), row["id"]


def test_an_image_block_spans_its_row_breaks_and_ends_before_text():
    from batchgen.generate.lanes.vision import media_blocks

    IMG, BREAK, END, TEXT = 7, 8, 9, 100
    ids = [1, IMG, IMG, BREAK, IMG, IMG, END, TEXT, TEXT, IMG, IMG, BREAK, IMG, IMG, END, TEXT]
    assert media_blocks(ids, IMG, {BREAK, END, 1}) == [(1, 6), (9, 14)]
    assert media_blocks([IMG, TEXT, IMG], IMG, {BREAK}) == [(0, 1), (2, 3)]  # text between: two images


@pytest.mark.parametrize(
    "family",
    ["sensitive_vlm", "sensitive_qwen2_5", "sensitive_qwen3_vl", "sensitive_qwen3_vl_moe",
     "sensitive_qwen3_5", "sensitive_qwen3_5:mtp", *(f"offset_families:{kind}" for kind in OFFSET_FAMILIES)],
)  # fmt: skip
def test_a_mixed_job_matches_mlx_vlm_row_by_row(tmp_path, request, family):
    """The issue's mixed job on a batched lane: multi-turn with the image in a later turn, a
    stop string, max_tokens 1, a ~600-token prompt beside a ~12-token one, two images in both
    orders (where the family takes several), each row against mlx-vlm's own generate (with
    `:mtp`, batched with Qwen3.5's MTP head against the target alone)."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.generate.load.loading import mend_processor

    name, _, kind = family.partition(":")
    model_dir = request.getfixturevalue(name)
    drafted = ("--draft-model", str(model_dir.parent / "drafter")) if kind == "mtp" else ()
    model_dir = model_dir[kind] if kind and not drafted else model_dir
    rng = np.random.default_rng(21)
    for k, shape in enumerate([(48, 64, 3), (72, 40, 3)]):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(tmp_path / f"m{k}.png")
    long_system = " ".join(["Look closely at every detail of the picture before you answer."] * 50)

    def part(text):
        return {"type": "text", "text": text}

    rows = [
        {"id": "later-turn", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi, show me."},
            {"role": "user", "content": [{"type": "image", "image": "m0.png"}, part("This one?")]}]},
        {"id": "long", "image": "m1.png", "system": long_system, "prompt": "Short?", "max_tokens": 6},
        {"id": "short", "image": "m1.png", "prompt": "Hm?", "max_tokens": 9},
        {"id": "one-token", "image": "m0.png", "prompt": "One word.", "max_tokens": 1},
        {"id": "stop", "image": "m0.png", "prompt": "Go on.", "max_tokens": 12, "stop": ["e", "4"]},
    ]  # fmt: skip
    several = kind not in ("llava", "llava_next")  # one image a prompt
    if several:
        for order in ("01", "10"):
            content = [*({"type": "image", "image": f"m{i}.png"} for i in order), part("Compare them.")]
            rows.append(
                {"id": f"two-{order}", "max_tokens": 7, "messages": [{"role": "user", "content": content}]}
            )
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(model_dir), "--temperature", "0",
                           "--batch-size", "3", *drafted)  # fmt: skip
    assert code == 0, output
    assert "one at a time" not in output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"], r["finish_reason"]) for r in read(out)}
    assert all(r["mtp_drafts"] > 0 for r in read(out) if r["completion_tokens"] > 1) == bool(drafted)

    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)
    tokenizer = processor.tokenizer
    seen = set()
    for row in rows:
        if "messages" in row:
            turns = [dict(m) for m in row["messages"]]
        else:
            user = [{"type": "image", "image": row["image"]}, part(row["prompt"])]
            turns = [{"role": "system", "content": row["system"]}] if "system" in row else []
            turns.append({"role": "user", "content": user})
        parts = [p for m in turns if isinstance(m["content"], list) for p in m["content"]]
        images = [Image.open(tmp_path / p["image"]).convert("RGB") for p in parts if p["type"] == "image"]
        for m in turns:
            if isinstance(m["content"], list):
                m["content"] = [{"type": "image"} if p["type"] == "image" else {**p, "content": p["text"]}
                                for p in m["content"]]  # fmt: skip
            else:
                m["content"] = _parts(m["content"])
        prompt = get_chat_template(processor, turns, True)
        tokens, stopped = [], False
        for r in mlx_vlm.stream_generate(model, processor, prompt, image=images, max_tokens=row["max_tokens"],
                                         temperature=0.0):  # fmt: skip
            if getattr(r, "token_ids", None) is not None or r.token is None:
                continue
            tokens.append(int(r.token))
            text = tokenizer.decode(tokens)
            if any(s in text for s in row.get("stop", [])):
                stopped = True
                break
        eos = tokens and tokens[-1] in tokenizer.stopping_criteria.eos_token_ids
        text = tokenizer.decode(tokens[:-1] if eos else tokens)
        for s in row.get("stop", []):
            text = text.split(s)[0]
        reason = "stop" if stopped or eos else "length"
        assert got[row["id"]] == (text, len(tokens), reason), row["id"]
        seen.add(text)
    assert len(seen) >= len(rows) - 1  # outputs differ row to row
    assert got["stop"][2] == "stop" and got["long"][1] == 6 and got["one-token"][1] == 1
    if several:
        assert got["two-01"] != got["two-10"]  # the order reaches the slots


def test_prompts_that_cannot_batch_on_a_batched_family_run_one_at_a_time(tmp_path, offset_families):
    """A Gemma 4 whose image tokens attend both ways goes through mlx-vlm's own generate:
    counted once per reason, output as mlx-vlm's. A LLaVA-NeXT row with two images (mlx-vlm
    merges the first only) is its own error."""
    import json
    import shutil

    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    bidirectional = tmp_path / "gemma4-bidirectional"
    shutil.copytree(offset_families["gemma4"], bidirectional)
    config = json.loads((bidirectional / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (bidirectional / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(4)
    for k in range(2):
        Image.fromarray(rng.integers(0, 256, (48, 40 + 8 * k, 3), dtype=np.uint8)).save(
            tmp_path / f"b{k}.png"
        )
    rows = [{"id": f"r{k}", "image": f"b{k}.png", "prompt": QUESTION, "max_tokens": 6} for k in range(2)]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    code, output = run_cli(
        "run", str(job), "-o", str(out), "--model", str(bidirectional), "--temperature", "0"
    )
    assert code == 0, output
    assert output.count("2 rows one at a time (gemma4: its image tokens attend both ways") == 1
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    model, processor = mlx_vlm.load(str(bidirectional))
    user = [{"type": "image"}, {"type": "text", "text": QUESTION, "content": QUESTION}]
    prompt = get_chat_template(processor, [{"role": "user", "content": user}], True)
    for k in range(2):
        picture = Image.open(tmp_path / f"b{k}.png").convert("RGB")
        ref = mlx_vlm.generate(model, processor, prompt, image=[picture], max_tokens=6, temperature=0.0)
        assert got[f"r{k}"] == (_text(processor, ref), len(ref.token_ids))

    two = [
        {"type": "image", "image": "b0.png"},
        {"type": "image", "image": "b1.png"},
        {"type": "text", "text": "?"},
    ]
    job = write_jsonl(tmp_path / "next.jsonl", [
        {"id": "two", "messages": [{"role": "user", "content": two}], "max_tokens": 3},
        {"id": "one", "image": "b0.png", "prompt": QUESTION, "max_tokens": 3},
        {"id": "clip", "video": str(MEDIA / "moving_dot.mp4"), "prompt": QUESTION, "max_tokens": 3},
    ])  # fmt: skip
    out = tmp_path / "next.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(offset_families["llava_next"]),
                           "--temperature", "0")  # fmt: skip
    assert code == 1, output  # mlx-vlm's llava_next merges the first image only: the rest went unseen
    two, one, clip = read(out)
    for row in (two, clip):  # a clip goes in as its frames, each an image
        assert row["error_stage"] == "generate" and "other frames) would go unseen" in row["error"]
    assert one["status"] == "ok" and "one at a time" not in output


def test_a_template_that_drops_string_content_gets_every_message_as_parts(offset_families, sensitive_vlm):
    """mlx-vlm's InternVL template walks a message's content as parts: a string system prompt or
    earlier turn vanished from the prompt. Such templates get the messages as parts; others the
    strings, unchanged."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.generate.chat.prompts import apply_template

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi, show me."},
        {"role": "user", "content": [{"type": "image"}, *_parts(QUESTION)]},
    ]
    _, internvl = mlx_vlm.load(str(offset_families["internvl_chat"]))
    assert "You are terse." not in get_chat_template(internvl, messages, True)  # as mlx-vlm renders it
    prompt = apply_template(internvl, messages, {})
    assert all(text in prompt for text in ("You are terse.", "Hello there.", "Hi, show me.", QUESTION))
    _, qwen = mlx_vlm.load(str(sensitive_vlm))
    assert apply_template(qwen, messages, {}) == get_chat_template(qwen, messages, True)


def test_n_completions_on_the_vision_lanes(workdir, sensitive_qwen3_5):
    """A row's `completions` on a batched lane (Qwen3.5's MTP rounds) and on the one-row lane
    (vision drafter rows with a penalty): greedy copies are the row's one answer; seeded sampled
    copies (seed, seed + 1, …: a wave each) differ from each other and repeat run to run."""
    import json

    rows = [
        {"id": "greedy", "image": "media/red_circle.png", "prompt": "Shape?", "completions": 3,
         "temperature": 0},
        {"id": "one", "image": "media/red_circle.png", "prompt": "Shape?", "temperature": 0},
        {"id": "sampled", "image": "media/red_circle.png", "prompt": "Same?", "completions": 3,
         "temperature": 1.5, "seed": 3},
        {"id": "penalised", "image": "media/red_circle.png", "prompt": "Same?", "completions": 3,
         "temperature": 1.5, "seed": 3, "repetition_penalty": 1.3},
    ]  # fmt: skip
    job = write_jsonl(workdir / "jobs.jsonl", rows)
    runs = []
    drafter = str(sensitive_qwen3_5.parent / "drafter")
    for name in ("a", "b"):
        out = workdir / f"{name}.parquet"
        code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_qwen3_5),
                               "--draft-model", drafter, "--max-tokens", "6")  # fmt: skip
        assert code == 0, output
        assert "1 row one at a time (vision drafter rows with penalties or biases" in output
        runs.append({r["id"]: r for r in read(out)})
    got = runs[0]
    greedy = [c["text"] for c in json.loads(got["greedy"]["choices"])]
    assert greedy == [got["one"]["generated_text"]] * 3 and got["one"]["choices"] is None
    assert got["greedy"]["completion_tokens"] == 3 * got["one"]["completion_tokens"]
    for row in ("sampled", "penalised"):
        sampled = [c["text"] for c in json.loads(got[row]["choices"])]
        assert len(set(sampled)) > 1 and runs[1][row]["choices"] == got[row]["choices"], row

"""The trained shapes captioner is the oracle: right answers prove each row got its own image."""

from __future__ import annotations

import json
import random
import sys

import pytest
from conftest import MODELS, ROOT, SAMPLE, read, run_cli, write_jsonl

sys.path.insert(0, str(ROOT / "scripts"))

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = MODELS / "shapes-vlm"


def _run(job, out, *flags):
    code, output = run_cli("run", str(job), "-o", str(out), "--model", str(CAPTIONER), "--temperature", "0",
                           "--max-tokens", "8", "-q", *flags)  # fmt: skip
    assert code == 0, output
    return read(out)


def test_the_shapes_job_is_answered_right_with_and_without_reuse(tmp_path):
    job = SAMPLE / "shapes.jsonl"
    rows = [json.loads(line) for line in job.read_text().splitlines()]
    assert all(rows[i]["image"] != rows[i + 1]["image"] for i in range(len(rows) - 1))  # shuffled
    fast = _run(job, tmp_path / "fast.parquet")
    slow = _run(job, tmp_path / "slow.parquet", "--no-cache", "--batch-size", "1")
    right = [r["generated_text"].strip() == r["expected"] for r in fast]
    assert sum(right) / len(right) >= 0.95, [(r["expected"], r["generated_text"]) for r in fast]
    assert [r["generated_text"] for r in fast] == [r["generated_text"] for r in slow]
    assert sum(r["cached_tokens"] > 0 for r in fast) >= len(fast) // 2


def test_swapped_images_would_be_caught(tmp_path):
    """Two images whose every answer differs, each asked all three questions, interleaved."""
    rng = random.Random(99)
    pair = [("circle", "red"), ("square", "blue")]
    rows = []
    for shape, colour in pair:
        shapes.draw(shape, colour, rng).save(tmp_path / f"{shape}.png")
    for question, answer in shapes.QUESTIONS.items():
        for shape, colour in pair:
            rows.append({"id": f"{shape}-{len(rows)}", "image": f"{shape}.png", "prompt": question,
                         "expected": answer(shape, colour)})  # fmt: skip
    job = write_jsonl(tmp_path / "pair.jsonl", rows)
    out = _run(job, tmp_path / "out.parquet")
    assert [r["generated_text"].strip() for r in out] == [r["expected"] for r in rows]


def test_training_steps_lower_the_loss(tmp_path):
    """The training script does not rot: a few steps on a handful of samples fit them."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_vlm

    from batchgen.tools.tiny.builder import make_tiny_model

    make_tiny_model(tmp_path / "init", "vlm", seed=3)
    model, processor = mlx_vlm.load(str(tmp_path / "init"))
    inputs = shapes.Inputs(model, processor)
    rng = random.Random(0)
    items = []
    for _ in range(6):
        img, shape, colour = shapes.sample(rng)
        question = rng.choice(list(shapes.QUESTIONS))
        items.append((img, question, shapes.QUESTIONS[question](shape, colour)))
    batch = inputs.batch(items)
    grad_fn = nn.value_and_grad(model, shapes.answer_loss)
    opt = optim.Adam(learning_rate=3e-3)
    losses = []
    for _ in range(12):
        loss, grads = grad_fn(model, *batch)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7, losses


@pytest.mark.parametrize("question", list(shapes.QUESTIONS))
def test_the_training_prompt_is_the_inference_prompt(question):
    """Trained image-first on batchgen's own template: the prompt the model sees at run time."""
    import mlx_vlm

    from batchgen.core.params import GenParams
    from batchgen.core.records import Media, MediaItem
    from batchgen.generate.router import Router
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow

    model, processor = mlx_vlm.load(str(CAPTIONER))
    inputs = shapes.Inputs(model, processor)
    engines = Router(str(CAPTIONER))
    job, _ = parse_row(RawRow(0, 1, {"image": "x.png", "prompt": question}), GenParams())
    img, _, _ = shapes.sample(random.Random(1))
    plan = engines.plan(job, Media([MediaItem("image", img, "d")]))
    batch_ids = inputs.batch([(img, question, "x")])[0][0].tolist()
    assert batch_ids[: len(plan.seq.ids)] == plan.seq.ids

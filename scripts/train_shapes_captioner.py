"""Train the tiny shapes captioner in sample_data/models/shapes-vlm, offline, on the CPU.

Synthetic data: a circle, square, triangle or star in red, green, blue, yellow or white,
at a few sizes and positions, on a plain or noisy dark background, 56x56 pixels. The model
is the sample's qwen2_vl architecture trained from scratch on exactly the inputs batchgen
builds at inference (its chat template, the image before the question, mlx-vlm's processor),
so what it learns is what `batchgen run` asks.

Two phases: the vision tower first learns shape and colour through a throwaway linear head
on its pooled features (end-to-end training alone plateaus), then the whole model learns
the answers with teacher forcing, loss on the answer tokens only.

    python scripts/train_shapes_captioner.py            # ~10-15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (40, 70, 230), "yellow": (235, 220, 30),
           "white": (245, 245, 245)}  # fmt: skip
QUESTIONS = {
    "What shape is this?": lambda s, c: s,
    "What colour is the shape?": lambda s, c: c,
    "Describe the image.": lambda s, c: f"a {c} {s}",
}
SIZE = 56  # the processor's 56x56 pixels: 4 image tokens


def draw(shape: str, colour: str, rng: random.Random) -> Image.Image:
    """One shape, upright, at a random size and place, on a dark plain or noisy background."""
    if rng.random() < 0.5:
        shade = rng.randint(0, 70)
        img = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
    else:
        noise = np.random.default_rng(rng.randint(0, 2**31)).integers(0, 80, (SIZE, SIZE, 3), dtype=np.uint8)
        img = Image.fromarray(noise)
    d = ImageDraw.Draw(img)
    r = rng.randint(12, 22)
    cx, cy = rng.randint(r + 2, SIZE - r - 2), rng.randint(r + 2, SIZE - r - 2)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = int(r * 0.85)
        d.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    else:
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.45
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        d.polygon(points, fill=fill)
    return img


def sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    return draw(shape, colour, rng), shape, colour


class Inputs:
    """Prompts built the way batchgen builds them at inference, tokenized by mlx-vlm."""

    def __init__(self, model, processor):
        from batchgen.core.records import GenParams
        from batchgen.generate.chat.prompts import apply_template, template_parts
        from batchgen.input.parse import parse_row
        from batchgen.input.read import RawRow

        self.model, self.processor = model, processor
        tok = processor.tokenizer
        self.pad = tok.convert_tokens_to_ids("<|endoftext|>")
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.prompts = {}
        for q in QUESTIONS:
            job, _ = parse_row(RawRow(0, 1, {"image": "x.png", "prompt": q}), GenParams())
            self.prompts[q] = apply_template(processor, template_parts(job.messages), {})
        self.answers = {}

    def answer_ids(self, text: str) -> list[int]:
        if text not in self.answers:
            self.answers[text] = self.processor.tokenizer.encode(text, add_special_tokens=False) + [self.end]
        return self.answers[text]

    def batch(self, items: list[tuple[Image.Image, str, str]]):
        """(input_ids, pixel_values, grid, targets, loss mask, positions) for teacher forcing."""
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs

        rows, targets, pixels, grids = [], [], [], []
        for img, question, answer in items:
            inp = prepare_inputs(self.processor, images=[img], prompts=self.prompts[question],
                                 image_token_index=self.model.config.image_token_id)  # fmt: skip
            prompt = inp["input_ids"][0].tolist()
            rows.append(prompt + self.answer_ids(answer))
            targets.append(len(prompt))
            pixels.append(inp["pixel_values"])
            grids.append(inp["image_grid_thw"])
        width = max(map(len, rows))
        ids = mx.array([r + [self.pad] * (width - len(r)) for r in rows])
        mask = mx.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        # Position t predicts token t+1: the loss covers the answer and its end-of-turn token.
        loss_mask = mx.array([[1.0 if start - 1 <= t < len(r) - 1 else 0.0 for t in range(width)]
                              for r, start in zip(rows, targets, strict=True)])  # fmt: skip
        grid = mx.concatenate(grids, axis=0)
        positions, _ = self.model.language_model.get_rope_index(ids, grid, None, mask)
        return ids, mx.concatenate(pixels, axis=0), grid, loss_mask, mx.stop_gradient(positions)


def forward(model, ids, pixels, grid, positions):
    features = model.vision_tower(pixels, grid)
    embeds = model.language_model.model.embed_tokens(ids)
    embeds = model.merge_input_ids_with_image_features(
        model.config.image_token_id, model.config.video_token_id, features, embeds, ids
    )
    hidden = model.language_model.model(ids, inputs_embeds=embeds, position_ids=positions)
    return model.language_model.model.embed_tokens.as_linear(hidden)


def answer_loss(model, ids, pixels, grid, loss_mask, positions):
    import mlx.core as mx
    import mlx.nn as nn

    logits = forward(model, ids, pixels, grid, positions)[:, :-1]
    losses = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="none")
    mask = loss_mask[:, :-1]
    return (losses * mask).sum() / mx.maximum(mask.sum(), 1)


def warm_vision(model, processor, rng: random.Random, steps: int, batch: int, log) -> None:
    """Teach the vision tower shape and colour through a linear head on pooled features."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    hidden = model.config.text_config.hidden_size

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = model.vision_tower
            self.head = nn.Linear(hidden, len(SHAPES) + len(COLOURS))

        def __call__(self, pixels, grid, n):
            return self.head(self.vision(pixels, grid).reshape(n, -1, hidden).mean(axis=1))

    probe = Probe()

    def loss_fn(probe, pixels, grid, shape_y, colour_y):
        logits = probe(pixels, grid, len(shape_y))
        return (nn.losses.cross_entropy(logits[:, : len(SHAPES)], shape_y).mean()
                + nn.losses.cross_entropy(logits[:, len(SHAPES) :], colour_y).mean())  # fmt: skip

    opt = optim.Adam(learning_rate=1e-3)
    grad_fn = nn.value_and_grad(probe, loss_fn)
    colours = list(COLOURS)
    for step in range(steps):
        items = [sample(rng) for _ in range(batch)]
        out = processor.image_processor(images=[i[0] for i in items])
        pixels, grid = mx.array(out["pixel_values"]), mx.array(out["image_grid_thw"])
        shape_y = mx.array([SHAPES.index(i[1]) for i in items])
        colour_y = mx.array([colours.index(i[2]) for i in items])
        loss, grads = grad_fn(probe, pixels, grid, shape_y, colour_y)
        opt.update(probe, grads)
        mx.eval(probe.parameters(), opt.state, loss)
        if step % 100 == 0 or step == steps - 1:
            log(f"vision warm-up step {step}: loss {loss.item():.3f}")


def evaluate(model, processor, inputs: Inputs, rng: random.Random, n: int) -> float:
    import mlx_vlm

    right = 0
    for k in range(n):
        img, shape, colour = sample(rng)
        question = list(QUESTIONS)[k % len(QUESTIONS)]
        out = mlx_vlm.generate(model, processor, inputs.prompts[question], image=[img], max_tokens=8,
                               temperature=0.0)  # fmt: skip
        right += out.text.strip() == QUESTIONS[question](shape, colour)
    return right / n


def train(out_dir: Path, minutes: float, seed: int = 0, log=print, warm_steps: int = 800, batch: int = 32,
          eval_every: int = 200, target: float = 0.97) -> dict:  # fmt: skip
    """Build a random qwen2_vl checkpoint, train it, save it to `out_dir`; returns the figures."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_vlm
    from mlx.utils import tree_flatten

    from batchgen.tools.tiny.builder import make_tiny_model

    started = time.perf_counter()
    init = out_dir.with_name(out_dir.name + ".init")
    shutil.rmtree(init, ignore_errors=True)
    make_tiny_model(init, "vlm", seed=seed)
    mx.random.seed(seed)
    model, processor = mlx_vlm.load(str(init))
    rng, eval_rng = random.Random(seed), random.Random(seed + 1)
    inputs = Inputs(model, processor)
    warm_vision(model, processor, rng, warm_steps, batch, log)

    warmup, constant = optim.linear_schedule(1e-5, 1e-3, 100), optim.linear_schedule(1e-3, 1e-3, 1)
    schedule = optim.join_schedules([warmup, constant], [100])  # constant beat cosine decay
    opt = optim.Adam(learning_rate=schedule)
    grad_fn = nn.value_and_grad(model, answer_loss)

    def step_fn(items):
        loss, grads = grad_fn(model, *inputs.batch(items))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        return loss.item()

    step, accuracy, losses = 0, 0.0, []
    deadline = started + minutes * 60
    while time.perf_counter() < deadline:
        items = []
        for _ in range(batch):
            img, shape, colour = sample(rng)
            question = rng.choice(list(QUESTIONS))
            items.append((img, question, QUESTIONS[question](shape, colour)))
        losses.append(step_fn(items))
        step += 1
        if step % eval_every == 0:
            accuracy = evaluate(model, processor, inputs, eval_rng, 150)
            recent = np.mean(losses[-eval_every:])
            log(f"step {step}: loss {recent:.3f}, accuracy on 150 fresh questions {accuracy:.1%}")
            if accuracy >= target:
                break
    final = evaluate(model, processor, inputs, random.Random(seed + 2), 300)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(init, out_dir)
    shutil.rmtree(init)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})  # fmt: skip
    figures = {
        "steps": step,
        "minutes": round((time.perf_counter() - started) / 60, 2),
        "accuracy_300": final,
        "last_loss": round(float(np.mean(losses[-50:])), 4) if losses else None,
    }
    (out_dir / "training.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--out", type=Path, default=ROOT / "sample_data" / "models" / "shapes-vlm")
    parser.add_argument("--minutes", type=float, default=16.0, help="training budget, warm-up included")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures = train(args.out, args.minutes, args.seed, log=lambda m: print(m, flush=True))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

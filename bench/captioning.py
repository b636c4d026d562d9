"""Captioning: 16 distinct 448x448 images x 4 questions, a shared ~800-token system prompt,
max_tokens 32, greedy, on a tiny VLM large enough that prefill matters. Three contenders in
one process, outputs compared token for token:

  (a) a per-row loop calling mlx_vlm.generate, the way a user would by hand;
  (b) an expert script: per image, one full prefill, then each further question from a copy
      of that PromptCacheState (mlx-vlm reuses the image prefix);
  (c) `batchgen run` on the same rows (model loading, I/O and Parquet writing included).

    python bench/captioning.py     # last line: batchgen speedup vs per-row loop: X; vs expert script: Y
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)

import batchgen  # noqa: E402
from batchgen.tools.tiny.builder import make_tiny_model  # noqa: E402
from batchgen.tools.tiny.parts import CHAT_TEMPLATE  # noqa: E402

IMAGES, QUESTIONS, MAX_TOKENS = 16, 4, 32
QUESTION_TEXT = ["What shape is this?", "What colour is it?", "Describe the image.", "Is it large or small?"]
SYSTEM = " ".join(
    "You are a careful assistant that looks at each image and answers the question about it "
    "in one short sentence, naming the colour, the shape and where it is in the picture.".split()
    * 15
)


def prompt_for(question: str) -> str:
    from jinja2 import Template

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]
    return Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def tokens_of(result, eos: set[int]) -> list[int]:
    ids = list(result.token_ids or [])
    return ids[:-1] if ids and ids[-1] in eos else ids


def per_row_loop(model, processor, images, eos):
    import mlx_vlm

    out = []
    for image in images:
        for q in QUESTION_TEXT:
            r = mlx_vlm.generate(
                model, processor, prompt_for(q), image=[image], max_tokens=MAX_TOKENS, temperature=0.0
            )
            out.append(tokens_of(r, eos))
    return out


def expert_script(model, processor, images, eos):
    import mlx_vlm
    from mlx_vlm.generate import PromptCacheState

    out = []
    for image in images:
        root = PromptCacheState()
        first = mlx_vlm.generate(
            model, processor, prompt_for(QUESTION_TEXT[0]), image=[image], max_tokens=MAX_TOKENS,
            temperature=0.0, prompt_cache_state=root,
        )  # fmt: skip
        out.append(tokens_of(first, eos))
        for q in QUESTION_TEXT[1:]:
            state = copy.deepcopy(root)
            r = mlx_vlm.generate(
                model, processor, prompt_for(q), image=[image], max_tokens=MAX_TOKENS, temperature=0.0,
                prompt_cache_state=state,
            )  # fmt: skip
            out.append(tokens_of(r, eos))
    return out


def workload(folder: Path, count: int = IMAGES) -> tuple[Path, list[Path]]:
    """The job's tiny VLM (large enough that prefill matters) and its distinct 448x448 images;
    bench/scores.py scores the same images on the same model."""
    model_dir = make_tiny_model(folder / "vlm", "vlm", image_size=448, hidden=128, layers=4, vision_embed=64)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        path = folder / f"img{i:02d}.png"
        Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return model_dir, paths


def main() -> None:
    import mlx_vlm

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir, paths = workload(folder)
        images = [Image.open(p).convert("RGB") for p in paths]
        rows = [
            {"id": f"{i}-{k}", "image": str(p), "system": SYSTEM, "prompt": q}
            for i, p in enumerate(paths)
            for k, q in enumerate(QUESTION_TEXT)
        ]
        job = folder / "jobs.jsonl"
        job.write_text("".join(json.dumps(r) + "\n" for r in rows))

        model, processor = mlx_vlm.load(str(model_dir))
        tokenizer = processor.tokenizer
        eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
        n_prompt = len(tokenizer.encode(prompt_for(QUESTION_TEXT[0])))
        print(f"{len(rows)} rows, prompt ~{n_prompt} text tokens + 256 image tokens, max_tokens {MAX_TOKENS}")

        mlx_vlm.generate(model, processor, prompt_for("warm up"), image=[images[0]], max_tokens=2)
        t0 = time.perf_counter()
        loop = per_row_loop(model, processor, images, eos)
        t_loop = time.perf_counter() - t0
        print(f"(a) per-row loop:   {t_loop:7.2f} s")
        t0 = time.perf_counter()
        expert = expert_script(model, processor, images, eos)
        t_expert = time.perf_counter() - t0
        print(f"(b) expert script:  {t_expert:7.2f} s")

        config = batchgen.build_config(
            job, folder / "out.parquet", None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            model=str(model_dir), quiet=True, batch_size=32,
        )  # fmt: skip
        t0 = time.perf_counter()
        summary = batchgen.run(config)
        t_batchgen = time.perf_counter() - t0
        print(f"(c) batchgen run:   {t_batchgen:7.2f} s  ({summary.work.generation.cache})")

        import pyarrow.parquet as pq

        texts = pq.read_table(folder / "out.parquet").column("generated_text").to_pylist()
        decoded = [tokenizer.decode(t) for t in loop]
        same_ab = loop == expert
        same_ac = decoded == texts
        print(f"identical outputs: loop = expert: {same_ab}, loop = batchgen: {same_ac}")
        x, y = t_loop / t_batchgen, t_expert / t_batchgen
        print(f"batchgen speedup vs per-row loop: {x:.2f}; vs expert script: {y:.2f}")


if __name__ == "__main__":
    fast_blas()
    main()

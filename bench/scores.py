"""Scoring for curation: 16 distinct 448x448 images x 4 yes/no statements (VQAScore's
"Does this figure show '...'? Please answer yes or no."), a shared ~800-token system prompt, on
the tiny VLM of bench/captioning.py. Side by side in one process:

  (a) a per-row loop: for each row and each answer, one reference forward pass over the prompt
      and the answer (mlx-vlm's model, no cache), the answer's log-probability summed by hand;
  (b) `batchgen run` with choices_to_score ["Yes", "No"] and score_only (loading, I/O and
      Parquet included): the prompt prefilled once from the prefix cache, answers batched;
  (c) `batchgen run` generating one token for the same rows, the cost scoring is measured against.

    python bench/scores.py   # last lines: speedup vs the loop (>= 4x); scoring / one token (<= 1.3x)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from captioning import workload  # noqa: E402  (bench/ is the script's folder, first on the path)

import batchgen  # noqa: E402
from batchgen.generate.lanes.scoring import answer_ids  # noqa: E402
from batchgen.tools.tiny.parts import CHAT_TEMPLATE  # noqa: E402

IMAGES = 16
STATEMENTS = ["a red circle", "a blue square", "a photo of a cat", "two people talking"]
ANSWERS = ["Yes", "No"]
SYSTEM = " ".join(
    "You are a careful assistant that looks at each image and says whether it shows what the "
    "question names, answering yes or no.".split()
    * 20
)


def question(statement: str) -> str:
    return f"Does this figure show '{statement}'? Please answer yes or no."


def prompt_for(text: str) -> str:
    from jinja2 import Template

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
    ]
    return Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def per_row_loop(model, processor, images, eos) -> list[list[float]]:
    import mlx.core as mx
    from mlx_vlm.utils import prepare_inputs

    tokenizer = processor.tokenizer
    answers = [answer_ids(tokenizer, a, eos) for a in ANSWERS]
    slot = getattr(model.config, "image_token_index", None)
    out = []
    for image in images:
        for statement in STATEMENTS:
            inputs = prepare_inputs(processor, images=[image], prompts=prompt_for(question(statement)),
                                    image_token_index=slot)  # fmt: skip
            ids = inputs["input_ids"][0].tolist()
            extra = {
                k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")
            }
            row = []
            for a in answers:
                logits = model(mx.array([ids + a]), inputs["pixel_values"], mask=None, **extra).logits[0]
                lp = logits.astype(mx.float32)
                lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
                row.append(sum(lp[len(ids) - 1 + j, t].item() for j, t in enumerate(a)))
            out.append(row)
    return out


def main() -> None:
    import mlx_vlm
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir, paths = workload(folder, IMAGES)
        images = [Image.open(p).convert("RGB") for p in paths]
        rows = [{"id": f"{i}-{k}", "image": str(p), "system": SYSTEM, "prompt": question(s)}
                for i, p in enumerate(paths) for k, s in enumerate(STATEMENTS)]  # fmt: skip
        scored = folder / "scored.jsonl"
        scored.write_text("".join(json.dumps({**r, "choices_to_score": ANSWERS, "score_only": True}) + "\n"
                                  for r in rows))  # fmt: skip
        plain = folder / "plain.jsonl"
        plain.write_text("".join(json.dumps(r) + "\n" for r in rows))

        model, processor = mlx_vlm.load(str(model_dir))
        eos = {processor.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        n_prompt = len(processor.tokenizer.encode(prompt_for("x")))
        print(f"{len(rows)} rows x {len(ANSWERS)} answers, prompt ~{n_prompt} text tokens + 256 image tokens")
        per_row_loop(model, processor, images[:1], eos)  # warm up
        t0 = time.perf_counter()
        loop = per_row_loop(model, processor, images, eos)
        t_loop = time.perf_counter() - t0
        print(f"(a) per-row reference loop:      {t_loop:7.2f} s")

        def run(job, out, **generation):
            config = batchgen.build_config(job, folder / out, None, {"temperature": 0.0, **generation},
                                           model=str(model_dir), quiet=True, batch_size=32)  # fmt: skip
            t = time.perf_counter()
            batchgen.run(config)
            return time.perf_counter() - t

        t_score = run(scored, "scored.parquet")
        print(f"(b) batchgen, score_only:        {t_score:7.2f} s")
        t_one = run(plain, "one.parquet", max_tokens=1)
        print(f"(c) batchgen, one token each:    {t_one:7.2f} s")
        got = [
            [c["logprob"] for c in r["choice_scores"]]
            for r in pq.read_table(folder / "scored.parquet").to_pylist()
        ]
        worst = max(abs(a - b) for r, s in zip(loop, got, strict=True) for a, b in zip(r, s, strict=True))
        print(f"scores equal within 1e-4: {worst < 1e-4} (largest difference {worst:.2e})")
        print(f"batchgen scoring speedup vs per-row loop: {t_loop / t_score:.2f}")
        print(f"scoring two answers / generating one token: {t_score / t_one:.2f}")


if __name__ == "__main__":
    fast_blas()
    main()

"""Per model family: 16 images x 4 questions under a shared system prompt, max_tokens 24,
greedy, on each family's tiny checkpoint (`make-tiny-model --kind ...`): batchgen against a
per-row `mlx_vlm.generate` loop, outputs compared; each side runs three times, alternating,
and the fastest run counts. Families on a batched lane should be >= 3x.

    python bench/families.py            # one line per family, then the ratios
    python bench/families.py llava      # only the named kinds
"""

from __future__ import annotations

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

IMAGES, MAX_TOKENS, ROUNDS = 16, 24, 3
QUESTIONS = [
    "What is in the picture?",
    "What colour dominates?",
    "Describe it briefly.",
    "Is it busy or calm?",
]
SYSTEM = ("You look at each picture and answer the question about it in one short sentence. " * 8).strip()
KINDS = {
    "vlm": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5", "llava": "llava", "llava_next": "llava_next", "smolvlm": "smolvlm",
    "idefics3": "idefics3", "gemma3": "gemma3", "gemma4": "gemma4", "mistral3": "mistral3",
    "internvl_chat": "internvl_chat",
}  # fmt: skip


def bench(kind: str, folder: Path, paths: list[Path]) -> tuple[float, float, bool]:
    import mlx_vlm
    import pyarrow.parquet as pq
    from mlx_vlm.prompt_utils import get_chat_template

    from batchgen.generate.load.loading import mend_processor

    if kind == "qwen3_5":  # the tiny Qwen3.5 (16 tokens an image) is the target of the MTP pair
        model_dir = make_tiny_model(folder / kind, "mtp-pair", sensitive=True) / "target"
    else:  # the Qwen-VLs at 112² pixels: 16 tokens an image, as the llava checkpoint has
        shape = {"image_size": 112} if kind in ("vlm", "qwen2_5_vl") else {}
        model_dir = make_tiny_model(folder / kind, kind, sensitive=True, **shape)
    rows = [{"id": f"{i}-{k}", "image": str(p), "system": SYSTEM, "prompt": q}
            for i, p in enumerate(paths) for k, q in enumerate(QUESTIONS)]  # fmt: skip
    job = folder / f"{kind}.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))

    model, processor = mlx_vlm.load(str(model_dir))
    mend_processor(processor)  # llava's processor fails under transformers 5 without it
    images = [Image.open(p).convert("RGB") for p in paths]

    def prompt(q: str) -> str:  # as batchgen renders it: the checkpoint's processor's template, media first
        user = [{"type": "image"}, {"type": "text", "text": q, "content": q}]
        system = [{"type": "text", "text": SYSTEM, "content": SYSTEM}]  # InternVL's template drops a string
        return get_chat_template(
            processor, [{"role": "system", "content": system}, {"role": "user", "content": user}], True
        )

    def per_row() -> tuple[float, list[str]]:
        t0 = time.perf_counter()
        texts = []
        for image in images:
            for q in QUESTIONS:
                r = mlx_vlm.generate(
                    model, processor, prompt(q), image=[image], max_tokens=MAX_TOKENS, temperature=0.0
                )
                ids = list(r.token_ids)
                texts.append(processor.tokenizer.decode(ids[:-1] if r.finish_reason == "stop" else ids))
        return time.perf_counter() - t0, texts

    def batched(k: int) -> tuple[float, list[str]]:
        out = folder / f"{kind}-{k}.parquet"
        config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
                                       model=str(model_dir), quiet=True)  # fmt: skip
        t0 = time.perf_counter()
        batchgen.run(config)
        return time.perf_counter() - t0, pq.read_table(out).column("generated_text").to_pylist()

    mlx_vlm.generate(model, processor, prompt("warm up"), image=[images[0]], max_tokens=2)
    warm = folder / f"{kind}-warm.jsonl"  # as the loop had its warm-up call: imports, first kernels
    warm.write_text(json.dumps(rows[0]) + "\n")
    batchgen.run(batchgen.build_config(warm, folder / f"{kind}-warm.parquet", None, {"max_tokens": 2},
                                       model=str(model_dir), quiet=True))  # fmt: skip
    # Each side ROUNDS times, alternating, the fastest taken: a ~1 s job is at the mercy of the box.
    runs = [(per_row(), batched(k)) for k in range(ROUNDS)]
    (_, loop), (_, texts) = runs[0]
    return min(r[0][0] for r in runs), min(r[1][0] for r in runs), texts == loop


def main() -> None:
    kinds = sys.argv[1:] or list(KINDS)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(0)
        paths = []
        for i in range(IMAGES):
            paths.append(folder / f"img{i:02d}.png")
            Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(paths[-1])
        print(f"{IMAGES} images x {len(QUESTIONS)} questions, shared system prompt, max_tokens {MAX_TOKENS}")
        ratios = {}
        for kind in kinds:
            t_loop, t_batchgen, same = bench(kind, folder, paths)
            ratios[kind] = t_loop / t_batchgen
            line = f"per-row mlx_vlm.generate {t_loop:6.2f} s, batchgen {t_batchgen:6.2f} s"
            print(f"{KINDS[kind]:10s} {line}, {ratios[kind]:.2f}x, identical outputs: {same}")
        print("ratios: " + ", ".join(f"{KINDS[k]} {r:.2f}" for k, r in ratios.items()))


if __name__ == "__main__":
    fast_blas()
    main()

"""Video captioning: 8 clips x 4 questions, max_tokens 24, greedy, on a tiny qwen2_vl large
enough that prefill matters. batchgen's batched lane (the clip's prefix computed once per
clip, rows decoded together) against the one-row lane it replaced: mlx-vlm's own generate,
row by row, fed the very frames batchgen samples. Outputs compared token for token.

    python bench/video.py     # last line: batched lane vs one-row lane: X
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)

import batchgen  # noqa: E402
from batchgen.tools.tiny.builder import make_tiny_model  # noqa: E402

CLIPS, MAX_TOKENS, SIDE = 8, 24, 224
QUESTIONS = ["What moves?", "Which way does it go?", "Describe the clip.", "What colour is the square?"]


def write_clip(path: Path, seed: int) -> None:
    """A 6 s clip at 8 fps: a coloured square crossing a noisy background."""
    import cv2

    rng = np.random.default_rng(seed)
    background = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    colour = [int(c) for c in rng.integers(0, 256, 3)]
    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 8, (SIDE, SIDE))
    for t in range(48):
        frame = background.copy()
        x = 4 * t % (SIDE - 40)
        frame[90:130, x : x + 40] = colour
        out.write(frame)
    out.release()


def main() -> None:
    import mlx_vlm
    import pyarrow.parquet as pq

    from batchgen.core.params import GenParams
    from batchgen.core.settings import MediaConfig
    from batchgen.generate.base.models import inspect_model
    from batchgen.input.parse import parse_row
    from batchgen.input.read import RawRow
    from batchgen.media.resolve import MediaStage

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir = make_tiny_model(folder / "vlm", "vlm", image_size=SIDE, hidden=128, layers=4)
        # The processor's max_pixels budgets a whole clip: room for 12 frames at full size, so a
        # clip costs what a real one does (hundreds of tokens), not a thumbnail's.
        config_path = model_dir / "preprocessor_config.json"
        config = json.loads(config_path.read_text())
        config.update(min_pixels=56 * 56, max_pixels=12 * SIDE * SIDE)
        config_path.write_text(json.dumps(config))
        for c in range(CLIPS):
            write_clip(folder / f"clip{c}.avi", c)
        rows = [
            {"id": f"{c}-{k}", "video": f"clip{c}.avi", "prompt": q}
            for c in range(CLIPS)
            for k, q in enumerate(QUESTIONS)
        ]
        job = folder / "jobs.jsonl"
        job.write_text("".join(json.dumps(r) + "\n" for r in rows))

        model, processor = mlx_vlm.load(str(model_dir))
        stage = MediaStage(
            MediaConfig(), folder, folder, False, inspect_model(str(model_dir)).max_pixels, threading.Event()
        )
        jobs = [parse_row(RawRow(c, c, rows[c * len(QUESTIONS)]), GenParams(), None)[0] for c in range(CLIPS)]
        frames = [stage.resolve(j).media.videos[0] for j in jobs]
        clip = "<|vision_start|><|video_pad|><|vision_end|>"
        clip_tokens = processor.tokenizer.encode(f"{clip}")
        n_video = len(
            mlx_vlm.utils.prepare_inputs(processor, videos=[frames[0]], prompts=clip)["input_ids"][0]
        ) - len(clip_tokens)
        print(f"{len(rows)} rows: {CLIPS} clips of {frames[0].shape[0]} frames ({n_video + 1} video tokens) "
              f"x {len(QUESTIONS)} questions, max_tokens {MAX_TOKENS}")  # fmt: skip

        mlx_vlm.generate(
            model, processor, f"<|im_start|>user\n{clip}Hi<|im_end|>\n", video=[frames[0]], max_tokens=2
        )
        t0 = time.perf_counter()
        loop = []
        for c in range(CLIPS):
            for q in QUESTIONS:
                prompt = f"<|im_start|>user\n{clip}{q}<|im_end|>\n<|im_start|>assistant\n"
                r = mlx_vlm.generate(model, processor, prompt, video=[frames[c]], max_tokens=MAX_TOKENS,
                                     temperature=0.0)  # fmt: skip
                ids = list(r.token_ids)
                loop.append(processor.tokenizer.decode(ids[:-1] if r.finish_reason == "stop" else ids))
        t_loop = time.perf_counter() - t0
        print(f"one-row lane (mlx_vlm.generate per row): {t_loop:7.2f} s")

        config = batchgen.build_config(
            job, folder / "out.parquet", None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            model=str(model_dir), quiet=True,
        )  # fmt: skip
        t0 = time.perf_counter()
        summary = batchgen.run(config)
        t_batched = time.perf_counter() - t0
        print(f"batchgen run, batched lane: {t_batched:7.2f} s  ({summary.work.generation.cache})")
        texts = pq.read_table(folder / "out.parquet").column("generated_text").to_pylist()
        print(f"identical outputs: {texts == loop}")
        print(f"batched lane vs one-row lane: {t_loop / t_batched:.2f}")


if __name__ == "__main__":
    fast_blas()
    main()

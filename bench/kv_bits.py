"""--kv-bits batched: 64 text rows (16 prompts × 4 lengths of max_tokens, greedy) on the tiny
qwen2 model (32-wide heads) with an 8-bit cache in groups of 32, run one at a time through
mlx-lm's own quantized generate (the path every --kv-bits row took before) and by batchgen at
widths 8 and 32 in one process, every row's token ids compared; the same for 32 image rows (8
pictures × 4 questions) on a tiny qwen2_vl with 32-wide heads against mlx-vlm's own quantized
generate; then the KV bytes per token of the quantized formats against a float16 cache,
measured on the arrays `mx.quantize` makes.

    python bench/kv_bits.py     # last lines: widths' speed-ups, and bytes per token per format
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from timed import timed_run  # noqa: E402

MODEL = ROOT / "sample_data" / "models" / "tiny-lm"
TOPICS = ["a red circle", "the sea at night", "a kitchen", "winter", "a train station", "an old map",
          "a thunderstorm", "a chess game", "a garden", "the moon", "a library", "a market",
          "a mountain path", "a violin", "a lighthouse", "a bakery"]  # fmt: skip
LENGTHS = [16, 32, 64, 96]
KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}


def _rows() -> list[dict]:
    return [{"id": f"t{k}-m{m}", "prompt": f"Tell me about {topic}.", "max_tokens": m}
            for k, topic in enumerate(TOPICS) for m in LENGTHS]  # fmt: skip


def _one_at_a_time(rows: list[dict]) -> tuple[float, dict[str, list[int]]]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(MODEL))
    t0 = time.perf_counter()
    out = {}
    for r in rows:
        messages = [{"role": "user", "content": r["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        stream = mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=r["max_tokens"], **KV)
        out[r["id"]] = [s.token for s in stream]
    return time.perf_counter() - t0, out


def _batchgen(rows: list[dict], width: int, model: Path = MODEL) -> tuple[float, dict[str, list[int]]]:
    """batchgen's run of `rows` with the bench's quantized cache; each row's token ids."""
    wall, out = timed_run(
        rows,
        {"temperature": 0.0, "logprobs": True},
        model=str(model),
        batch_size=width,
        kv_bits=KV["kv_bits"],
        kv_group_size=KV["kv_group_size"],
        quantized_kv_start=KV["quantized_kv_start"],
    )
    return wall, {r["id"]: [t["id"] for t in r["logprobs"]] for r in out}


def _images(tmp: Path) -> None:
    import mlx_vlm
    import numpy as np
    from PIL import Image

    from batchgen.tools.tiny.builder import make_tiny_model

    model_dir = make_tiny_model(tmp / "vlm", "vlm", sensitive=True, hidden=128)
    rng = np.random.default_rng(0)
    for k in range(8):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(tmp / f"p{k}.png")
    questions = ["Describe the image.", "What colours are there?", "Is there text?", "Name one shape."]
    rows = [
        {"id": f"p{k}-q{q}", "image": str(tmp / f"p{k}.png"), "prompt": question, "max_tokens": 48}
        for q, question in enumerate(questions)
        for k in range(8)
    ]
    model, processor = mlx_vlm.load(str(model_dir))
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    t0 = time.perf_counter()
    want = {}
    for r in rows:
        prompt = f"<|im_start|>user\n{slot}{r['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        picture = Image.open(r["image"]).convert("RGB")
        out = mlx_vlm.generate(
            model, processor, prompt, image=[picture], max_tokens=48, temperature=0.0, **KV
        )
        want[r["id"]] = list(out.token_ids)
    times = {1: time.perf_counter() - t0}
    made = sum(len(t) for t in want.values())
    print(
        f"{len(rows)} image rows, one at a time (mlx-vlm's quantized generate): {made / times[1]:7.1f} tok/s"
    )
    same = True
    for width in (8, 32):
        times[width], got = _batchgen(rows, width, model_dir)
        same = same and all(got[i] == want[i] for i in want)
        print(f"image rows, batchgen width {width:>2}: {made / times[width]:7.1f} tok/s")
    print(f"identical image token ids one at a time and at widths 8 and 32: {same}")
    print(
        f"--kv-bits image rows at width 8: {times[1] / times[8]:.2f}× one at a time; "
        f"at width 32: {times[1] / times[32]:.2f}×"
    )


def _bytes_per_token() -> None:
    """A layer's keys and values for 1,024 tokens of 8 heads × 128 dims, as a float16 cache
    holds them and as `mx.quantize` packs them (values, then a scale and a bias per group)."""
    import mlx.core as mx

    tokens, shape = 1024, (1, 8, 1024, 128)
    full = mx.random.normal(shape).astype(mx.float16)
    base = 2 * full.nbytes / tokens
    print(f"KV bytes per token per layer (8 heads × 128): float16 {base:,.0f}")
    for bits in (8, 4):
        for group in (32, 64, 128):
            packed = mx.quantize(full, group_size=group, bits=bits)
            per = 2 * sum(p.nbytes for p in packed) / tokens
            print(f"  {bits}-bit, groups of {group:>3}: {per:,.0f} ({per / base:.3f}× float16)")


def main() -> None:
    rows = _rows()
    print(f"{len(rows)} text rows, greedy, max_tokens {LENGTHS}, tiny qwen2, --kv-bits 8 --kv-group-size 32")
    _batchgen(rows[:4], 4)  # warm up
    times, tokens = {}, {}
    times[1], tokens[1] = _one_at_a_time(rows)
    made = sum(len(t) for t in tokens[1].values())
    print(f"one at a time (mlx-lm's quantized generate): {times[1]:7.2f} s, {made / times[1]:7.1f} tok/s")
    for width in (8, 32):
        times[width], tokens[width] = _batchgen(rows, width)
        print(f"batchgen width {width:>2}: {times[width]:7.2f} s, {made / times[width]:7.1f} tok/s")
    same = all(tokens[1][i] == tokens[8][i] == tokens[32][i] for i in tokens[1])
    print(f"identical token ids one at a time and at widths 8 and 32: {same}")
    print(
        f"--kv-bits rows at width 8: {times[1] / times[8]:.2f}× one at a time; "
        f"at width 32: {times[1] / times[32]:.2f}×"
    )
    with tempfile.TemporaryDirectory() as tmp:
        _images(Path(tmp))
    _bytes_per_token()


if __name__ == "__main__":
    fast_blas()
    main()

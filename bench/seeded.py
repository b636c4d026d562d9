"""Seeded sampling: 200 rows (4 prompts x 50 seeds, temperature 0.8, top_p 0.9, max_tokens 64) on
the tiny qwen2 model, run by batchgen at widths 1, 8 and 32 in one process — width 1 is the
one-at-a-time path seeded rows took before they batched; 8 and 32 each in another row order —
with every row's token ids compared across the three runs.

    python bench/seeded.py     # last line: seeded rows at width 8: X× width 1; at width 32: Y×
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from timed import timed_run  # noqa: E402

MODEL = ROOT / "sample_data" / "models" / "tiny-lm"
PROMPTS = ["Tell me a story about a red circle.", "Describe the sea at night.",
           "List ten things in a kitchen.", "Write a short poem about winter."]  # fmt: skip
SEEDS, MAX_TOKENS, TEMPERATURE = 50, 64, 0.8


def _run(rows: list[dict], width: int) -> tuple[float, dict[str, list[int]]]:
    generation = {"temperature": TEMPERATURE, "max_tokens": MAX_TOKENS, "logprobs": True}
    wall, out = timed_run(rows, generation, model=str(MODEL), batch_size=width)
    return wall, {r["id"]: [t["id"] for t in r["logprobs"]] for r in out}


def main() -> None:
    rows = [{"id": f"p{k}-s{s}", "prompt": p, "seed": s} for k, p in enumerate(PROMPTS) for s in range(SEEDS)]
    print(f"{len(rows)} seeded rows, temperature {TEMPERATURE}, max_tokens {MAX_TOKENS}, tiny qwen2")
    _run(rows[:4], 4)  # warm up
    times, tokens = {}, {}
    for width, order in ((1, 0), (8, 1), (32, 2)):
        shuffled = rows[:]
        random.Random(order).shuffle(shuffled)
        times[width], tokens[width] = _run(shuffled if order else rows, width)
        made = sum(len(t) for t in tokens[width].values())
        print(f"width {width:>2}: {times[width]:7.2f} s, {made / times[width]:7.1f} tok/s")
    same = all(tokens[1][i] == tokens[8][i] == tokens[32][i] for i in tokens[1])
    distinct = len({tuple(t) for t in tokens[1].values()})
    print(
        f"identical token ids at widths 1, 8 and 32, in three row orders: {same}; {distinct} distinct answers"
    )
    speedups = f"{times[1] / times[8]:.2f}× width 1; at width 32: {times[1] / times[32]:.2f}×"
    print(f"seeded rows at width 8: {speedups}")


if __name__ == "__main__":
    fast_blas()
    main()

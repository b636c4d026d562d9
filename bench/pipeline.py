"""The pipelined decode step: 96 greedy text rows (max_tokens 64 to 112) and 32 seeded ones
(temperature 0.8) on the tiny qwen2 model, run by batchgen at widths 1, 8 and 32, three times
each way in one process, alternating: with every step read at once (the host reads a step's
tokens before the next is queued, as before) and pipelined (the next step queued with
`mx.async_eval` before the host reads this one); the best of each, and the outputs compared.

    python bench/pipeline.py [--fast-blas]   # last line: pipelined / read-at-once per width
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from timed import timed_run  # noqa: E402

from batchgen.generate.decode.decoder import DecodeBatch  # noqa: E402

MODEL = ROOT / "sample_data" / "models" / "tiny-lm"
ROUNDS = 3


def _rows() -> list[dict]:
    greedy = [
        {"id": f"g{i}", "prompt": f"Tell me about thing {i}.", "max_tokens": 64 + (i % 4) * 16}
        for i in range(96)
    ]
    seeded = [
        {"id": f"s{i}", "prompt": f"Write about place {i}.", "max_tokens": 64, "temperature": 0.8, "seed": i}
        for i in range(32)
    ]
    return greedy + seeded


def _run(rows: list[dict], width: int) -> tuple[float, dict[str, tuple[str, int]]]:
    wall, out = timed_run(rows, {"temperature": 0.0}, model=str(MODEL), batch_size=width)
    return wall, {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in out}


def main() -> None:
    rows = _rows()
    print(f"{len(rows)} text rows (96 greedy, 32 seeded), tiny qwen2")
    _run(rows[:8], 8)  # warm up
    pipelined_on_device = DecodeBatch._on_device
    ratios = []
    for width in (1, 8, 32):
        times: dict[str, list[float]] = {"at once": [], "pipelined": []}
        outputs = {}
        for _ in range(ROUNDS):  # interleaved, the best of each: two cores make single runs noisy
            DecodeBatch._on_device = lambda self, i: False  # type: ignore[method-assign]  # every step read at once
            wall, outputs["at once"] = _run(rows, width)
            times["at once"].append(wall)
            DecodeBatch._on_device = pipelined_on_device  # type: ignore[method-assign]
            wall, outputs["pipelined"] = _run(rows, width)
            times["pipelined"].append(wall)
        at_once, piped = min(times["at once"]), min(times["pipelined"])
        ratios.append(f"width {width}: {at_once / piped:.2f}×")
        same = outputs["at once"] == outputs["pipelined"]
        print(
            f"width {width:>2}: read at once {at_once:6.2f} s, pipelined {piped:6.2f} s "
            f"(best of {ROUNDS}), same outputs: {same}"
        )
    print(f"pipelined decode / read at once: {', '.join(ratios)}")


if __name__ == "__main__":
    fast_blas()
    main()

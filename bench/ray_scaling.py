"""Ray Data scale-out on this machine: rows/s with 1 and 2 actors against the local engine,
same job, same output. Two cores bound what can show here; the point is the path to a cluster.

    python bench/ray_scaling.py     # last line: 2 actors / 1 actor rows/s ratio: X
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import batchgen  # noqa: E402

ROWS = 256


def timed(job: Path, out: Path, **overrides) -> float:
    config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": 16}, quiet=True,
                                   overwrite=True, **overrides)  # fmt: skip
    t0 = time.perf_counter()
    summary = batchgen.run(config)
    assert summary.ok == ROWS, summary
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "jobs.jsonl"
        job.write_text(
            "".join(json.dumps({"id": i, "prompt": f"Tell me about item {i}."}) + "\n" for i in range(ROWS))
        )
        lm = str(ROOT / "sample_data" / "models" / "tiny-lm")
        local = timed(job, Path(tmp) / "local.parquet", model=lm)
        print(f"local engine:     {ROWS / local:6.1f} rows/s ({local:.1f} s)")
        rates = {}
        for workers in (1, 2):
            wall = timed(job, Path(tmp) / f"ray{workers}.parquet", model=lm, engine="ray", workers=workers)
            rates[workers] = ROWS / wall
            print(f"ray, {workers} actor(s):  {rates[workers]:6.1f} rows/s ({wall:.1f} s with Ray start-up)")
    print(f"2 actors / 1 actor rows/s ratio: {rates[2] / rates[1]:.2f}")


if __name__ == "__main__":
    main()

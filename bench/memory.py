"""Peak memory of a long text job: 100,000 rows against 1,000 rows (max_tokens 1, a text
model smaller still than the sample's, since speed is not the point), each in its own
process. The reader streams, queues are bounded and the writer flushes, so the peak should
hardly grow with the row count.

    python bench/memory.py          # last line: peak RSS growth 1k→100k: N MB
    python bench/memory.py 20000    # a shorter check
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgen.tiny import make_tiny_model  # noqa: E402

CHILD = """
import resource, sys
from pathlib import Path
import batchgen
job, out, model = sys.argv[1:4]
config = batchgen.build_config(Path(job), Path(out), None, {"temperature": 0.0, "max_tokens": 1},
                               model=model, quiet=True)
summary = batchgen.run(config)
assert summary.ok == summary.rows, summary
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, summary.rows)
"""


def peak_mb(rows: int, folder: Path, model: str) -> tuple[int, float]:
    job = folder / f"jobs-{rows}.jsonl"
    with job.open("w") as f:
        for i in range(rows):
            f.write(
                json.dumps({"id": f"row-{i}", "prompt": f"Say something about item {i}.", "tag": i % 7})
                + "\n"
            )
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(job), str(folder / f"out-{rows}.parquet"), model],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    mb, count = map(int, done.stdout.split())
    assert count == rows
    return mb, time.perf_counter() - t0


def main() -> None:
    big = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "lm", "lm", hidden=32, layers=1))
        small_mb, small_s = peak_mb(1_000, Path(tmp), model)
        print(f"1,000 rows: peak RSS {small_mb} MB ({small_s:.0f} s)")
        big_mb, big_s = peak_mb(big, Path(tmp), model)
        print(f"{big:,} rows: peak RSS {big_mb} MB ({big_s:.0f} s)")
    print(f"peak RSS growth 1k→{big // 1000}k: {big_mb - small_mb} MB")


if __name__ == "__main__":
    main()

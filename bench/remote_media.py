"""Is fetching hidden behind generation? 64 distinct images, served with 100 ms latency by a
local server, against the same images as local paths, on the tiny VLM.

    python bench/remote_media.py            # last line: remote/local wall ratio: X.XX
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mediaserver import MediaServer  # noqa: E402

import batchgen  # noqa: E402

ROWS = 64
LATENCY = 0.1
MAX_TOKENS = 32  # the tiny VLM has random weights: every row generates all of them


def make_images(folder: Path) -> list[str]:
    rng = np.random.default_rng(0)
    names = []
    for i in range(ROWS):
        pixels = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:02d}.png")
        names.append(f"img{i:02d}.png")
    return names


def serve(folder: Path, delay: float, ports) -> None:
    """The media server lives in its own process, as a real one would: it must not take the
    GIL from the run being measured."""
    with MediaServer(folder) as server:
        server.delay = delay
        ports.put(server.server_port)
        threading.Event().wait()


def timed_run(job: Path, out: Path) -> float:
    config = batchgen.build_config(
        job,
        out,
        None,
        {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        {"allow_private_urls": True},
        model=str(ROOT / "sample_data" / "models" / "tiny-vlm"),
        overwrite=True,
        quiet=True,
    )
    t0 = time.perf_counter()
    summary = batchgen.run(config)
    assert summary.failed == 0, summary
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "media").mkdir()
        names = make_images(folder / "media")
        ports: multiprocessing.Queue = multiprocessing.Queue()
        server = multiprocessing.Process(target=serve, args=(folder / "media", LATENCY, ports), daemon=True)
        server.start()
        try:
            url = f"http://127.0.0.1:{ports.get(timeout=30)}"
            jobs = {}
            refs = {"local": "media/{}", "remote": url + "/img/{}"}
            for kind, ref in refs.items():
                jobs[kind] = folder / f"{kind}.jsonl"
                rows = [
                    {"id": i, "image": ref.format(n), "prompt": "Describe it."} for i, n in enumerate(names)
                ]
                jobs[kind].write_text("".join(json.dumps(r) + "\n" for r in rows))
            timed_run(jobs["local"], folder / "warmup.parquet")  # page in models and kernels
            best = {"local": float("inf"), "remote": float("inf")}
            for _ in range(2):
                for kind in ("local", "remote"):
                    best[kind] = min(best[kind], timed_run(jobs[kind], folder / f"{kind}.parquet"))
            serial = ROWS * LATENCY
        finally:
            server.terminate()
        print(f"rows: {ROWS}, latency per image: {LATENCY * 1000:.0f} ms (serially: +{serial:.1f} s)")
        print(f"local paths: {best['local']:.2f} s, remote URLs: {best['remote']:.2f} s (best of 2)")
        print(f"remote/local wall ratio: {best['remote'] / best['local']:.2f}")


if __name__ == "__main__":
    main()

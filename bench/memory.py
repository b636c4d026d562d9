"""Peak memory, each run in its own process.

1. A long text job: 100,000 rows against 1,000 rows (max_tokens 1, a text model smaller
   still than the sample's, since speed is not the point). The reader streams, queues are
   bounded and the writer flushes, so the peak should hardly grow with the row count.
2. Hostile media on the sample's tiny VLM: a 3 MB AVI of 128 frames at 2048x2048, and one
   row of six 7.7 KB PNGs of 7900x7900. Frames are downscaled as they are read and a row's
   decoded pixels are bounded, so each peak stays under 1 GB (a small image row is the base).

3. A dataset job as img2dataset writes it: a Parquet of 200,000 rows (`key`, a small JPEG in
   `jpg`, `caption`) against 2,000, mapped with --image-column/--id-column and a prompt
   template, max_tokens 1, written to a folder of shards: the shards are made as parts pile
   up, so the output is never one table in memory, and the images are never copied into it.
4. Byte bombs: a 20 KB sparse tar of eight 400 MB `.png` members, and a small zstd Parquet of
   eight 400 MB zero cells. Members and cells are capped before they are read whole, and
   undecoded bytes count in the look-ahead bound: each peak stays under 1 GB.

    python bench/memory.py          # last lines: peak RSS growth 1k→100k, then the media peaks
    python bench/memory.py 20000    # a shorter text check
    python bench/memory.py media    # the media peaks alone
    python bench/memory.py i2d      # the dataset job: peak RSS growth 2k→200k
    python bench/memory.py bytes    # the byte bombs alone
    python bench/memory.py i2d 20000
    python bench/memory.py plan     # the plan over a 1M-row prompt-major JSONL job: its peak and time
    python bench/memory.py mixed    # the memory budget: 200 short rows and 20 long ones
5. The whole-job plan (input/plan.py) of a 1,000,000-row JSONL job laid out prompt-major
   (333,334 pictures x 3 questions): the scan with its share keys and the grouping, then the
   rows streamed in plan order (held back up to the 512 MiB default horizon).
6. The memory budget (`mixed`): 200 short rows (25 words) and 20 long ones (1,000 words, 40x),
   shuffled, max_tokens 32, greedy, on the sample's tiny-lm, under a budget of a third of what
   32 long rows need (weights apart), against the unbudgeted run: MLX's peak, peak RSS, wall
   time, the widths decode steps ran at, outputs compared.
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

from batchgen.tools.tiny.builder import make_tiny_model  # noqa: E402

CHILD = """
import json, resource, sys
from pathlib import Path
import batchgen
job, out, model, media, more = sys.argv[1:6]
more = json.loads(more)
config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": 1},
                               json.loads(media), more.pop("columns", None), model=model, quiet=True, **more)
summary = batchgen.run(config)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, summary.rows, summary.ok)
"""

BOMB_PARQUET = """
import sys
import pyarrow as pa, pyarrow.parquet as pq
path, size = sys.argv[1], int(sys.argv[2])
schema = pa.schema([("id", pa.string()), ("image", pa.binary()), ("prompt", pa.string())])
with pq.ParquetWriter(path, schema, compression="zstd") as w:
    for i in range(8):
        w.write_table(pa.table({"id": [f"r{i}"], "image": [bytes(size)], "prompt": ["What?"]}, schema))
"""


PLAN_CHILD = """
import resource, sys, time
from batchgen.core.settings import Columns
from batchgen.input.plan import Grouping, share_keys
from batchgen.input.read import iter_rows, scan
t0 = time.perf_counter()
index = scan(sys.argv[1], share=share_keys(Columns()))
grouping = Grouping(index)
t1 = time.perf_counter()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, round(t1 - t0, 1), grouping.figures.groups)
rows = sum(1 for _ in grouping.ordered(iter_rows(index.source), 512 * 2**20, 256))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, round(time.perf_counter() - t1, 1), rows)
"""


def plan_peak(folder: Path, rows: int = 1_000_000) -> None:
    """Peak RSS and time of the scan and plan of a prompt-major job, then of its rows in plan order."""
    job = folder / "plan.jsonl"
    pictures = -(-rows // 3)
    with job.open("w") as f:
        for i in range(rows):
            q, p = divmod(i, pictures)
            row = {"id": f"r{i}", "image": f"pics/{p:07d}.jpg", "prompt": f"Question {q}?"}
            f.write(json.dumps(row) + "\n")
    done = subprocess.run([sys.executable, "-c", PLAN_CHILD, str(job)], capture_output=True, text=True,
                          check=True)  # fmt: skip
    (mb, seconds, groups), (mb2, seconds2, count) = (line.split() for line in done.stdout.split("\n")[:2])
    print(f"{rows:,}-row job: scan + plan peak RSS {mb} MB in {seconds} s ({int(groups):,} groups); "
          f"rows streamed in plan order: peak RSS {mb2} MB, {seconds2} s more "
          f"({int(count):,} rows)")  # fmt: skip


def run_child(
    job: Path, model: str, media: dict | None = None, out: str | None = None, **more
) -> tuple[int, int, int]:
    """(peak RSS in MB, rows, ok rows) of one run in a fresh process."""
    out = out or str(job.with_suffix(".parquet"))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(job), out, model, json.dumps(media or {}), json.dumps(more)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    mb, rows, ok = map(int, done.stdout.split())
    return mb, rows, ok


def i2d_peak(rows: int, folder: Path, model: str) -> tuple[int, float]:
    """Peak RSS of an img2dataset-style Parquet job of `rows` rows written to shards."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(256):  # distinct small pictures, as a crawl's are (each row's its own decode)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    job = folder / f"i2d-{rows}.parquet"
    with pq.ParquetWriter(
        job, pa.schema([("key", pa.string()), ("jpg", pa.binary()), ("caption", pa.string())])
    ) as w:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            w.write_table(pa.table({
                "key": [f"{start + i:09d}" for i in range(n)],
                "jpg": [jpegs[(start + i) % 256] for i in range(n)],
                "caption": [f"picture {start + i} from the crawl" for i in range(n)],
            }))  # fmt: skip
    t0 = time.perf_counter()
    columns = {"image": ["jpg"], "id": "key"}
    mb, count, ok = run_child(job, model, out=f"{folder}/i2d-{rows}-out/", columns=columns,
                              prompt_template="Describe it. Alt text: {caption}")  # fmt: skip
    assert count == ok == rows, (count, ok)
    return mb, time.perf_counter() - t0


def peak_mb(rows: int, folder: Path, model: str) -> tuple[int, float]:
    job = folder / f"jobs-{rows}.jsonl"
    with job.open("w") as f:
        for i in range(rows):
            f.write(
                json.dumps({"id": f"row-{i}", "prompt": f"Say something about item {i}.", "tag": i % 7})
                + "\n"
            )
    t0 = time.perf_counter()
    mb, count, ok = run_child(job, model)
    assert count == ok == rows
    return mb, time.perf_counter() - t0


def hostile_media(folder: Path) -> None:
    """Peak RSS of the two inputs that used to take 3.2 and 3.3 GB."""
    import cv2
    import numpy as np
    from PIL import Image

    model = str(ROOT / "sample_data" / "models" / "tiny-vlm")
    Image.new("RGB", (448, 448), "red").save(folder / "small.png")
    writer = cv2.VideoWriter(str(folder / "big.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 25, (2048, 2048))
    rng = np.random.default_rng(0)
    for _ in range(128):
        frame = np.zeros((2048, 2048, 3), np.uint8)
        frame[::64, ::64] = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)  # a little detail per frame
        writer.write(frame)
    writer.release()
    for i in range(6):
        huge = Image.new("1", (7900, 7900))
        huge.putpixel((i, i), 1)  # six different images: no decode is shared
        huge.save(folder / f"huge{i}.png")
    avi, png = (folder / "big.avi").stat().st_size / 2**20, (folder / "huge0.png").stat().st_size / 1024
    sizes = f"AVI {avi:.1f} MB, PNG {png:.1f} KB"
    jobs = {
        "one 448² image (base)": {"image": "small.png"},
        "AVI 128 x 2048²": {"video": "big.avi", "video_max_frames": 128, "video_fps": 25.0},
        "AVI, frames kept at Qwen-VL's 602,112 px": {
            "video": "big.avi",
            "video_max_frames": 128,
            "video_fps": 25.0,
        },
        "six PNGs of 7900²": {"images": [f"huge{i}.png" for i in range(6)]},
    }
    print(f"hostile media ({sizes}):")
    for name, row in jobs.items():
        job = folder / f"media-{len(name)}.jsonl"
        job.write_text(json.dumps({"id": name, "prompt": "What is it?", **row}) + "\n")
        mb, _, ok = run_child(job, model, {"frame_pixels": 602_112} if "Qwen" in name else None)
        print(f"  {name}: peak RSS {mb} MB ({'ok' if ok else 'row error'})")


def byte_bombs(folder: Path) -> None:
    """Peak RSS of the two small files that used to take 3.5 and 5.2 GB."""
    import tarfile

    model = str(ROOT / "sample_data" / "models" / "tiny-vlm")
    size = 400 * 2**20
    tar = folder / "bomb.tar"
    with open(tar, "wb") as f:  # headers only: the members' bodies are holes in a sparse file
        for i in range(8):
            member = tarfile.TarInfo(f"{i:05d}.png")
            member.size = size
            f.write(member.tobuf())
            f.seek(size, 1)
        f.write(b"\0" * 1024)
    parquet = folder / "bomb.parquet"
    # Written by another process: a child's peak RSS starts at its parent's RSS when it forks.
    subprocess.run([sys.executable, "-c", BOMB_PARQUET, str(parquet), str(size)], check=True)
    on_disk = tar.stat().st_blocks * 512 // 1024
    print(f"byte bombs (tar {on_disk} KB on disk, Parquet {parquet.stat().st_size // 1024} KB):")
    for name, job in (("tar of eight 400 MB .png", tar), ("Parquet of eight 400 MB cells", parquet)):
        mb, rows, ok = run_child(job, model, out=str(folder / f"{job.stem}.out.parquet"))
        print(f"  {name}: peak RSS {mb} MB ({rows} rows, {ok} ok)")


MIXED_CHILD = """
import json, resource, sys, time
import mlx.core as mx
import batchgen
job, out, model, budget = sys.argv[1:5]
config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": 32}, model=model,
                               quiet=True, memory_budget=budget)
t0 = time.perf_counter()
batchgen.run(config)
wall = time.perf_counter() - t0
stats = json.load(open(out + ".stats.json"))
print(json.dumps({"peak": mx.get_peak_memory(), "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "wall": wall, "widths": stats["memory"]["widths"]}))
"""


def mixed(folder: Path) -> None:
    import random

    import mlx_lm
    import pyarrow.parquet as pq

    from batchgen.generate.decode.adapters import LMAdapter
    from batchgen.generate.decode.memory import batch_need, footprint, weights_bytes
    from batchgen.tools.tiny.parts import WORDS

    model_dir = str(ROOT / "sample_data" / "models" / "tiny-lm")
    rng = random.Random(0)
    rows = [{"id": f"s{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(25))} for i in range(200)]
    rows += [{"id": f"l{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(1000))} for i in range(20)]
    rng.shuffle(rows)
    job = folder / "mixed.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tokenizer = mlx_lm.load(model_dir)
    fp = footprint(model, LMAdapter(model).make_cache())
    long = max(len(tokenizer.encode(r["prompt"])) for r in rows) + 20  # the chat template's tokens
    wide = batch_need(fp, [long + 32] * 32, long)
    budget = weights_bytes(model) + wide // 3
    print(f"220 rows; 32 long rows need {wide / 2**20:.0f} MiB; budget {budget / 2**20:.1f} MiB "
          f"(weights {weights_bytes(model) / 2**20:.1f} MiB + a third)")  # fmt: skip
    del model
    figures, texts = {}, {}
    for name, value in (("unbudgeted", "off"), ("budgeted", str(budget))):
        out = str(folder / f"{name}.parquet")
        done = subprocess.run([sys.executable, "-c", MIXED_CHILD, str(job), out, model_dir, value],
                              capture_output=True, text=True, check=True)  # fmt: skip
        figures[name] = json.loads(done.stdout.strip().splitlines()[-1])
        texts[name] = {r["id"]: r["generated_text"] for r in pq.read_table(out).to_pylist()}
        f = figures[name]
        widths = ", ".join(f"{w}: {n}" for w, n in sorted(f["widths"].items(), key=lambda x: -int(x[0])))
        print(f"{name:>10}: MLX peak {f['peak'] / 2**20:6.1f} MiB, peak RSS {f['rss'] // 1024} MB, "
              f"{f['wall']:.1f} s" + (f", decode steps by width {{{widths}}}" if widths else ""))  # fmt: skip
    same = sum(texts["budgeted"][k] == v for k, v in texts["unbudgeted"].items())
    b, u = figures["budgeted"], figures["unbudgeted"]
    print(f"identical: {same} of {len(rows)}; peak / budget {b['peak'] / budget:.2f}; "
          f"wall budgeted / unbudgeted {b['wall'] / u['wall']:.2f}")  # fmt: skip


def main() -> None:
    if sys.argv[1:] == ["mixed"]:
        with tempfile.TemporaryDirectory() as tmp:
            return mixed(Path(tmp))
    if sys.argv[1:] == ["bytes"]:
        with tempfile.TemporaryDirectory() as tmp:
            return byte_bombs(Path(tmp))
    if sys.argv[1:] == ["plan"]:
        with tempfile.TemporaryDirectory() as tmp:
            return plan_peak(Path(tmp))
    if sys.argv[1:] == ["media"]:
        with tempfile.TemporaryDirectory() as tmp:
            return hostile_media(Path(tmp))
    if sys.argv[1:2] == ["i2d"]:
        big = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000
        model = str(ROOT / "sample_data" / "models" / "tiny-vlm")
        with tempfile.TemporaryDirectory() as tmp:
            small_mb, small_s = i2d_peak(2_000, Path(tmp), model)
            print(f"2,000 rows: peak RSS {small_mb} MB ({small_s:.0f} s)")
            big_mb, big_s = i2d_peak(big, Path(tmp), model)
            print(f"{big:,} rows: peak RSS {big_mb} MB ({big_s:.0f} s)")
            print(f"peak RSS growth 2k→{big // 1000}k: {big_mb - small_mb} MB")
        return
    big = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "lm", "lm", hidden=32, layers=1))
        small_mb, small_s = peak_mb(1_000, Path(tmp), model)
        print(f"1,000 rows: peak RSS {small_mb} MB ({small_s:.0f} s)")
        big_mb, big_s = peak_mb(big, Path(tmp), model)
        print(f"{big:,} rows: peak RSS {big_mb} MB ({big_s:.0f} s)")
        print(f"peak RSS growth 1k→{big // 1000}k: {big_mb - small_mb} MB")
        hostile_media(Path(tmp))
        byte_bombs(Path(tmp))


if __name__ == "__main__":
    main()

"""Row order: one job of 120 distinct 448x448 pictures x 3 questions (the captioning bench's
model and system prompt, max_tokens 32, greedy) laid out three ways, run by `batchgen run`
at the defaults (window 256 rows, 50 prefix snapshots: more pictures than either holds):

  image-major   each picture's questions side by side (the best case);
  prompt-major  every picture with the first question, then with the second, ... (a script
                looping over questions writes this);
  shuffled      the rows in a random order.

Each run's time, its ratio to image-major, the time spent outside the lanes (the run's
time less the rows' generate_ms, which add up to the time the lanes ran: loading, reading,
waiting for media, planning, writing), the prompt tokens its prefix cache saved, and whether
its outputs equal image-major's, by id. With --baseline, prompt-major again with
the whole-job plan off (--plan-horizon 0: rows in job order, grouped only within a window),
as main ran before the plan. With --between, each order again with --no-plan-aside (every
window's rows planned between windows, as before the planning thread), to set their time
outside the lanes and their whole time beside the default runs'. Then `batchgen plan
--calibrate 16`'s projection against the measured image-major time.

    python bench/order.py [--fast-blas] [--baseline] [--between] [--pictures 120] [--window 256]
                          [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from captioning import MAX_TOKENS, QUESTION_TEXT, SYSTEM, workload  # noqa: E402

import batchgen  # noqa: E402
from batchgen.execution.plan import plan_job  # noqa: E402

QUESTIONS = QUESTION_TEXT[:3]


def layouts(paths: list[Path]) -> dict[str, list[dict]]:
    rows = {(i, k): {"id": f"{i}-{k}", "image": str(p), "system": SYSTEM, "prompt": q}
            for i, p in enumerate(paths) for k, q in enumerate(QUESTIONS)}  # fmt: skip
    image_major = [rows[i, k] for i in range(len(paths)) for k in range(len(QUESTIONS))]
    prompt_major = [rows[i, k] for k in range(len(QUESTIONS)) for i in range(len(paths))]
    shuffled = list(image_major)
    random.Random(0).shuffle(shuffled)
    return {"image-major": image_major, "prompt-major": prompt_major, "shuffled": shuffled}


def write_job(folder: Path, name: str, rows: list[dict]) -> Path:
    job = folder / f"{name.replace(', ', '-').replace(' ', '-')}.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return job


def config_for(job: Path, model: Path, **settings):
    return batchgen.build_config(
        job, job.with_suffix(".parquet"), None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
        model=str(model), quiet=True, overwrite=True, **settings,
    )  # fmt: skip


def run(config) -> tuple[float, dict, object, float]:
    """The run's time, its outputs by id, its summary and its time outside the lanes."""
    t0 = time.perf_counter()
    summary = batchgen.run(config)
    elapsed = time.perf_counter() - t0
    table = pq.read_table(
        config.output, columns=["id", "generated_text", "status", "generate_ms"]
    ).to_pylist()
    assert all(r["status"] == "ok" for r in table), [r for r in table if r["status"] != "ok"][:3]
    lanes = sum(r["generate_ms"] for r in table) / 1000
    return elapsed, {r["id"]: r["generated_text"] for r in table}, summary, elapsed - lanes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", action="store_true", help="also prompt-major without the plan")
    parser.add_argument("--between", action="store_true", help="also each order with --no-plan-aside")
    parser.add_argument("--pictures", type=int, default=120)
    parser.add_argument("--window", type=int, default=256, help="rows a window takes (--window)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each order, in turn; the best counts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, paths = workload(folder, args.pictures)
        jobs = layouts(paths)
        print(f"{len(paths)} pictures x {len(QUESTIONS)} questions = {len(jobs['image-major'])} rows, "
              f"max_tokens {MAX_TOKENS}, window {args.window}, 50 prefix snapshots; "
              f"best of {args.rounds}")  # fmt: skip
        run(config_for(write_job(folder, "warm-up", jobs["image-major"][:6]), model))  # first compiles
        names = list(jobs) + (["prompt-major, no plan"] if args.baseline else [])
        names += [f"{name}, between" for name in jobs] if args.between else []
        configs = {
            name: config_for(write_job(folder, name, jobs[name.split(",")[0]]), model,
                             plan_horizon=0 if "no plan" in name else 512, plan_aside="between" not in name,
                             window=args.window)
            for name in names
        }  # fmt: skip
        times: dict[str, float] = {}
        outputs, saved, prompt, outside = {}, {}, {}, {}
        for _ in range(args.rounds):
            for name in names:
                elapsed, outputs[name], summary, around = run(configs[name])
                if elapsed <= times.get(name, elapsed):
                    times[name], outside[name] = elapsed, around
                saved[name] = c.prompt_tokens_saved if (c := summary.work.generation.cache) else 0
                prompt[name] = summary.prompt_tokens
        for name in names:
            same = outputs[name] == outputs["image-major"]
            print(f"{name:22s} {times[name]:7.2f} s  {times[name] / times['image-major']:5.2f}x image-major  "
                  f"outside the lanes {outside[name]:5.2f} s  {saved[name]:8,} prompt tokens saved  "
                  f"outputs identical: {same}")  # fmt: skip
        worst = max(times[n] / times["image-major"] for n in ("prompt-major", "shuffled"))
        print(f"worst order with the plan: {worst:.2f}x image-major")
        for name in ("image-major", "prompt-major"):
            report = plan_job(configs[name], calibrate=16)
            c = report.calibration
            print(f"plan --calibrate 16, {name}: projected {c.projected_s:.1f} s, measured "
                  f"{times[name]:.1f} s ({c.projected_s / times[name]:.2f}x); prompt tokens "
                  f"{report.prompt_tokens:,} (the run's: {prompt[name]:,})")  # fmt: skip


if __name__ == "__main__":
    fast_blas()
    main()

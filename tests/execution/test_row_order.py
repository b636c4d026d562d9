"""Any row order runs as the best one: rows sharing a picture meet wherever they stand in the job,
and `batchgen plan` says before a run what it will do, counting what the run counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import batch, read, run_cli, write_jsonl
from PIL import Image

import batchgen

SYSTEM = "You are a careful assistant that answers in one short sentence. " * 4


def _layouts(folder, pictures=8, questions=2):
    rng = np.random.default_rng(3)
    for i in range(pictures):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
    row = {(i, q): {"id": f"i{i}q{q}", "image": f"im{i}.png", "system": SYSTEM, "prompt": f"Question {q}?"}
           for i in range(pictures) for q in range(questions)}  # fmt: skip
    image_major = [row[i, q] for i in range(pictures) for q in range(questions)]
    prompt_major = [row[i, q] for q in range(questions) for i in range(pictures)]
    return {name: write_jsonl(folder / f"{name}.jsonl", rows)
            for name, rows in (("image-major", image_major), ("prompt-major", prompt_major))}  # fmt: skip


def _run(job, model, **settings):
    out = job.with_suffix(".parquet")
    config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": 6}, model=str(model),
                                   quiet=True, **settings)  # fmt: skip
    return batchgen.run(config), read(out)


def test_a_prompt_major_job_reuses_every_picture_as_an_image_major_one(tmp_path, sensitive_vlm):
    jobs = _layouts(tmp_path)
    small = {"window": 4, "cache_entries": 2}  # a window and cache far smaller than the job's pictures
    best, best_rows = _run(jobs["image-major"], sensitive_vlm, **small)
    planned, rows = _run(jobs["prompt-major"], sensitive_vlm, **small)
    (tmp_path / "off").mkdir()
    off_job = tmp_path / "off" / "prompt-major.jsonl"
    off_job.write_text(jobs["prompt-major"].read_text())
    for name in (f"im{i}.png" for i in range(8)):
        (tmp_path / "off" / name).write_bytes((tmp_path / name).read_bytes())
    unplanned, off_rows = _run(off_job, sensitive_vlm, plan_horizon=0, **small)

    def answers(rs):
        return {r["id"]: (r["generated_text"], r["completion_tokens"], r["prompt_tokens"]) for r in rs}

    assert answers(rows) == answers(best_rows) == answers(off_rows)  # the same tokens, whatever the order
    assert len(set(answers(best_rows).values())) > 4  # the checkpoint tells the pictures apart
    job_order = [json.loads(line)["id"] for line in jobs["prompt-major"].read_text().splitlines()]
    assert [r["id"] for r in rows] == job_order
    assert planned.work.generation.cache.prompt_tokens_saved == best.work.generation.cache.prompt_tokens_saved
    assert (
        unplanned.work.generation.cache.prompt_tokens_saved
        < planned.work.generation.cache.prompt_tokens_saved
    )
    assert all(r["cached_tokens"] > 0 for r in rows if r["id"].endswith("q1"))


def test_plan_counts_what_the_run_counts_and_writes_nothing(tmp_path, sensitive_vlm):
    job = _layouts(tmp_path, pictures=5)["prompt-major"]
    more = [{"id": "bad", "image": "missing.png", "prompt": "x"}, {"id": "text", "prompt": "Hi"}]
    write_jsonl(job, [*map(json.loads, job.read_text().splitlines()), *more])
    out = tmp_path / "out.parquet"
    args = ["--model", str(sensitive_vlm), "--temperature", "0", "--max-tokens", "6"]
    code, text = run_cli("plan", str(job), "-o", str(out), "--json", *args)
    assert code == 0, text
    report = json.loads(text)
    assert list(tmp_path.glob("out*")) == []  # no output, no parts, no lock
    assert (report["job_rows"], report["todo"], report["pictures"], report["grouped"]) == (12, 12, 6, 10)
    assert report["failing"] == {"fetch": 1} and report["lanes"] == {"vlm": 10, "lm": 1}
    code, text = run_cli("run", str(job), "-o", str(out), "--quiet", *args)
    assert code == 1, text  # the missing picture
    rows = read(out)
    assert report["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert report["reused_tokens"] == sum(r["cached_tokens"] for r in rows)
    assert report["media_tokens"] > 0
    code, text = run_cli("run", str(job), "-o", str(out), "--dry-run", *args)
    assert code == 0 and "12 in the job, 0 to do (12 done before)" in text, text  # not transient: not retried
    code, text = run_cli("plan", str(job), "-o", str(out), "--retry-failed", *args)
    assert code == 0 and "1 to do (11 done before)" in text, text
    assert "fail before generating: fetch 1" in text, text


@pytest.mark.slow
def test_calibration_projects_the_run(tmp_path, sensitive_vlm):
    job = _layouts(tmp_path, pictures=6)["prompt-major"]
    code, text = run_cli("plan", str(job), "--json", "--calibrate", "4", "--model", str(sensitive_vlm),
                         "--temperature", "0", "--max-tokens", "6")  # fmt: skip
    assert code == 0, text
    c = json.loads(text)["calibration"]
    assert c["rows"] == 4 and c["prefill_s"] > 0 and c["decode_s"] > 0
    assert c["projected_s"] > c["load_s"] + 12 * (c["prefill_s"] + c["decode_s"]) * 0.99
    assert not list(tmp_path.glob("*.parquet*"))


def test_shards_never_decode_one_picture_twice(tmp_path, sensitive_vlm):
    job = _layouts(tmp_path, pictures=9, questions=3)["prompt-major"]
    decoded, ids = 0, []
    for k in range(3):
        out = tmp_path / f"s{k}.parquet"
        code, text = batch(job, out, "--model", str(sensitive_vlm), "--shard", f"{k}/3")
        assert code == 0, text
        decoded += json.loads((tmp_path / f"s{k}.parquet.stats.json").read_text())["media"]["image_decodes"]
        ids += [r["id"] for r in read(out)]
    assert sorted(ids) == sorted(f"i{i}q{q}" for i in range(9) for q in range(3))
    assert decoded == 9

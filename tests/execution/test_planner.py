"""Planning aside (the default; --no-plan-aside plans between windows): the next window's rows
planned on a thread while this one decodes give the rows planned between windows, token for
token, on every lane the thread can plan for, and the rows it must hand back (a model to load,
LLaVA-NeXT's lazy graph) are planned at home."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from conftest import read, write_jsonl
from PIL import Image

import batchgen


def _job(folder, pictures=6):
    rng = np.random.default_rng(5)
    rows = []
    for i in range(pictures):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
        rows += [{"id": f"i{i}q{q}", "image": f"im{i}.png", "prompt": f"Question {q}?"} for q in range(2)]
    # text rows after the pictures: their model loads in a later window, at home
    rows += [{"id": f"t{k}", "prompt": f"Say something about {k * 7} apples."} for k in range(6)]
    return write_jsonl(folder / "job.jsonl", rows)


def _answers(job, model, aside: bool) -> dict:
    out = job.with_name(f"out-{aside}.parquet")
    config = batchgen.build_config(
        job, out, None, {"temperature": 0.0, "max_tokens": 6}, model=str(model), quiet=True,
        window=4, batch_size=2, plan_aside=aside,
    )  # fmt: skip
    batchgen.run(config)
    rows = read(out)
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["status"] != "ok"]
    return {r["id"]: (r["generated_text"], r["completion_tokens"], r["prompt_tokens"]) for r in rows}


def _planned_aside(caplog) -> int:
    said = [m for r in caplog.records if (m := re.match(r"planned aside: (\d+) rows", r.getMessage()))]
    assert len(said) == 1
    return int(said[0].group(1))


def test_rows_planned_aside_are_the_rows_planned_at_home(tmp_path, sensitive_vlm, caplog):
    job = _job(tmp_path)
    home = _answers(job, sensitive_vlm, aside=False)
    with caplog.at_level(logging.DEBUG, logger="batchgen.execution.local"):
        aside = _answers(job, sensitive_vlm, aside=True)
    assert aside == home
    assert len({text for text, _, _ in home.values()}) > 8  # the checkpoint tells rows apart
    # all but the first window's rows and the first text row (its model loads at home)
    assert len(home) - 2 - 1 >= _planned_aside(caplog) >= len(home) // 2


def test_a_lazy_graph_row_is_planned_at_home(tmp_path, offset_families, caplog):
    job = _job(tmp_path, pictures=4)
    home = _answers(job, offset_families["llava_next"], aside=False)
    with caplog.at_level(logging.DEBUG, logger="batchgen.execution.local"):
        aside = _answers(job, offset_families["llava_next"], aside=True)
    assert aside == home
    assert _planned_aside(caplog) <= 6  # only text rows: every picture row hands its graph back


@pytest.mark.parametrize("kind", ["gemma3", "smolvlm"])
def test_offset_families_plan_aside(tmp_path, offset_families, kind):
    job, model = _job(tmp_path, pictures=3), offset_families[kind]
    assert _answers(job, model, aside=True) == _answers(job, model, aside=False)

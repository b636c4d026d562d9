"""A staged job (caption → yes/no score of the caption → keep_if → tags) in one run: the same
columns as three `batchgen run`s chained by hand on the id, resumable by stage, a changed stage
redone with the ones after it, a hostile keep_if refused before any work."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import MEDIA, read, run_cli, write_jsonl

CAPTION = "Describe the picture."
SCORE = 'Does "{caption.generated_text}" describe the picture? Answer yes or no.'
TAGS = "Three tags for a picture described as: {caption.generated_text}"
PICTURES = ["red_circle.png", "blue_square.webp", "green_triangle_rotated.jpg"]


def _job(tmp_path):
    """Six picture rows, their paths relative to the job's folder (a later stage reads its job
    from elsewhere: the paths still start here)."""
    (tmp_path / "media").mkdir(exist_ok=True)
    for name in PICTURES:
        shutil.copy(MEDIA / name, tmp_path / "media" / name)
    rows = [{"id": f"p{i}", "image": f"media/{name}", "note": f"n{i}"} for i, name in enumerate(PICTURES * 2)]
    return write_jsonl(tmp_path / "jobs.jsonl", rows)


def _preset(tmp_path, model, threshold: float, tags: str = TAGS):
    stages = [
        {"name": "caption", "prompt_template": CAPTION, "generation": {"max_tokens": 10}},
        {
            "name": "score",
            "prompt_template": SCORE,
            "generation": {"choices_to_score": ["yes", "no"], "score_only": True},
            "keep_if": f"score.choice_scores.yes > {threshold!r}",
        },
        {"name": "tags", "prompt_template": tags, "generation": {"max_tokens": 6}},
    ]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"model": str(model), "generation": {"temperature": 0}, "stages": stages}))
    return path


def _shapes_preset(tmp_path, stages) -> Path:
    """A preset of `stages` on the bundled shapes captioner."""
    preset = tmp_path / "p.yaml"
    shapes = MEDIA.parent / "models" / "shapes-vlm"
    preset.write_text(yaml.safe_dump({"model": str(shapes), "stages": stages}))
    return preset


def _by_hand(tmp_path, model, job):
    """The three runs chained by hand: each later job made from the earlier outputs by id."""

    def run(name, job, template, *flags):
        out = tmp_path / f"hand-{name}.parquet"
        code, output = run_cli(
            "run",
            str(job),
            "-o",
            str(out),
            "--model",
            str(model),
            "--temperature",
            "0",
            "--prompt-template",
            template,
            "-q",
            *flags,
        )
        assert code == 0, output
        return {r["id"]: r for r in read(out)}

    first = run("caption", job, CAPTION, "--max-tokens", "10")
    rows = [
        {"id": i, "image": r["image"], "caption.generated_text": r["generated_text"]}
        for i, r in first.items()
    ]
    second = run(
        "score",
        write_jsonl(tmp_path / "hand2.jsonl", rows),
        SCORE,
        "--choices-to-score",
        "yes",
        "--choices-to-score",
        "no",
        "--score-only",
    )
    yes = {i: next(c["prob"] for c in r["choice_scores"] if c["choice"] == "yes") for i, r in second.items()}
    return first, second, yes, run, rows


def test_a_staged_job_equals_the_runs_chained_by_hand(tmp_path, sensitive_vlm):
    job = _job(tmp_path)
    first, second, yes, run, rows = _by_hand(tmp_path, sensitive_vlm, job)
    threshold = sorted(yes.values())[len(yes) // 2 - 1]  # about half the rows go on
    kept = [r for r in rows if yes[r["id"]] > threshold]
    assert 0 < len(kept) < len(rows)
    third = run("tags", write_jsonl(tmp_path / "hand3.jsonl", kept), TAGS, "--max-tokens", "6")

    out = tmp_path / "staged.parquet"
    preset = _preset(tmp_path, sensitive_vlm, threshold)
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "-q")
    assert code == 0, output
    staged = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(staged) == sorted(first)  # a row per job row
    for i, row in staged.items():
        assert row["note"] == f"n{i[1:]}" and row["image"] == first[i]["image"]  # the job's columns
        assert row["caption.generated_text"] == first[i]["generated_text"]
        assert row["caption.completion_tokens"] == first[i]["completion_tokens"]
        assert [c["choice"] for c in row["score.choice_scores"]] == ["yes", "no"]
        assert all(
            math.isclose(a["prob"], b["prob"], rel_tol=1e-6)
            for a, b in zip(row["score.choice_scores"], second[i]["choice_scores"], strict=True)
        )
        if i in third:
            assert row["dropped_at"] is None and row["tags.generated_text"] == third[i]["generated_text"]
        else:
            assert row["dropped_at"] == "score" and row["tags.generated_text"] is None
    assert len({r["caption.generated_text"] for r in staged.values()}) >= 3  # they follow the pictures
    # the later stages ran on the model stage 1 loaded, found each picture decoded (three
    # pictures, one decode each in the whole job) and its prefix cached: at least as many tokens
    # as a picture's second row finds on its own (the hand-run score stage's best)
    folder = out.with_name("staged.parquet.stages")
    stats = [json.loads(p.read_text()) for p in sorted(folder.glob("*.stats.json"))]
    assert [s["model_loads"] for s in stats] == [1, 0, 0]
    assert [s["media"]["image_decodes"] for s in stats] == [3, 0, 0]
    assert [s["media"]["image_decode_reuses"] for s in stats] == [3, 6, len(third)]
    picture_prefix = max(r["cached_tokens"] for r in second.values())
    assert picture_prefix > 0 and all(r["score.cached_tokens"] >= picture_prefix for r in staged.values())

    # run again: every stage is done, nothing generated, nothing rewritten

    def stamps(pattern: str) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in folder.glob(pattern) if ".job." not in p.name}

    before = stamps("0?-*[a-z].parquet")
    assert len(before) == 3
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset))
    assert code == 0, output
    assert stamps("0?-*[a-z].parquet") == before and pq.read_table(out).to_pylist() == list(staged.values())
    # the last stage changed: it alone runs again, the stages before are kept
    kept_stamps = stamps("0[12]-*[a-z].parquet")
    preset = _preset(tmp_path, sensitive_vlm, threshold, tags="Two tags: {caption.generated_text}")
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "-q")
    assert code == 0, output
    again = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert stamps("0[12]-*[a-z].parquet") == kept_stamps
    assert all(again[i]["caption.generated_text"] == staged[i]["caption.generated_text"] for i in staged)
    assert any(again[i]["tags.generated_text"] != staged[i]["tags.generated_text"] for i in third)


@pytest.mark.parametrize(
    ("keep_if", "says"),
    [
        ("colour > 0.5", "stage score: keep_if: unknown name(s) colour"),
        ("tags.status == 'ok'", "stage score: keep_if: unknown name(s) tags.status"),  # a later stage's
        ("score.choice_scores.yes.__class__", "a name is words joined by dots"),
        ("__import__('os')", "Call is not part of the rule language"),
        ("score.choice_scores.yes > 1e400", "numbers up to"),
        ("not " * 50 + "note", "too large a rule"),
    ],
)
def test_a_hostile_keep_if_stops_the_run_before_any_work(tmp_path, keep_if, says):
    job = _job(tmp_path)
    stages = [
        {"name": "caption", "prompt_template": CAPTION},
        {"name": "score", "prompt_template": SCORE, "keep_if": keep_if},
    ]
    preset = _shapes_preset(tmp_path, stages)
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "-q")
    assert code == 2 and says in output, output
    assert not out.exists() and not out.with_name("out.parquet.stages").exists()


@pytest.mark.parametrize(
    ("stages", "says"),
    [
        ([{"name": "Caption"}], "stage 1's name 'Caption' must be like caption"),
        ([{"name": "a"}, {"name": "a"}], "two stages are named 'a'"),
        ([{"name": "id"}], "stage 1's name 'id'"),
        ([{"name": "a", "batch_size": 0}], "stage a: batch_size must be >= 1"),
        ([{"name": "a", "stages": []}], "stage a: a stage holds no stages"),
        ([{"name": "a", "generation": {"max_tokens": -1}}], "stage a: "),
        ("caption", "stages: a list of 1 to 16 stages"),
    ],
)
def test_bad_stages_are_config_errors_naming_the_stage(tmp_path, stages, says):
    preset = _shapes_preset(tmp_path, stages)
    code, output = run_cli(
        "run", str(_job(tmp_path)), "-o", str(tmp_path / "o.parquet"), "--config", str(preset)
    )
    assert code == 2 and says in output, output


def test_stage_values_name_each_scored_choice_and_each_stages_own_value():
    from batchgen.execution.stages import stage_values

    row = {
        "caption.status": "ok",
        "caption.generated_text": "A cat.",
        "score.status": "ok",
        "score.choice_scores": [{"choice": "yes", "prob": 0.7}, {"choice": "no", "prob": 0.3}],
        "x": 1,
    }
    values = stage_values(row)
    assert values == {
        **row,
        "score.choice_scores.yes": 0.7,
        "score.choice_scores.no": 0.3,
        "score": 0.7,
        "caption": "A cat.",
    }


@pytest.mark.slow  # a run killed mid-stage, in a subprocess
def test_kill_9_during_stage_2_then_a_rerun_keeps_stage_1(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    rows = [{"id": f"r{i:02}", "topic": f"topic {i}"} for i in range(40)]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    stages = [
        {"name": "word", "prompt_template": "One word about {topic}.", "generation": {"max_tokens": 3}},
        {
            "name": "essay",
            "prompt_template": "Write about {word.generated_text}.",
            "generation": {"max_tokens": 120},
        },
    ]
    preset = tmp_path / "p.yaml"
    preset.write_text(
        yaml.safe_dump(
            {
                "model": str(MEDIA.parent / "models" / "tiny-lm"),
                "batch_size": 2,
                "generation": {"temperature": 0},
                "stages": stages,
            }
        )
    )
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.stages" / "02-essay.parquet.partial"
    argv = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out), "--config", str(preset), "-q"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            if list(parts.glob("part-*.parquet")) or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before stage 2 committed a batch"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    code, said = run_cli("status", str(out))
    assert code == 4 and "out.parquet: incomplete · 0 of 40 rows, 40 pending" in said, said
    assert "stage 1 word: complete · 40 rows" in said and "stage 2 essay: incomplete" in said, said
    folder = tmp_path / "out.parquet.stages"
    stage_1 = (folder / "01-word.parquet").stat().st_mtime_ns
    code, output = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "-q")
    assert code == 0, output
    assert (folder / "01-word.parquet").stat().st_mtime_ns == stage_1  # stage 1 was not run again
    second = json.loads((folder / "02-essay.parquet.stats.json").read_text())
    assert second["resumed"] >= 2 and second["generated"] + second["resumed"] == 40
    ids = [r["id"] for r in pq.read_table(out).to_pylist()]
    assert sorted(ids) == [f"r{i:02}" for i in range(40)]  # every id once
    assert all(r["essay.status"] == "ok" for r in pq.read_table(out).to_pylist())


def test_rows_a_later_stage_has_not_answered_are_pending_not_stopped(tmp_path):
    """A stage that ends early (its own --limit here; a --time-limit or a kill alike) leaves the
    rows it has not answered to do: the job says incomplete everywhere, none is `dropped_at` it."""
    from batchgen.output.about import About, Standing

    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "topic": f"topic {i}"} for i in range(4)])
    stages = [
        {"name": "word", "prompt_template": "One word about {topic}.", "generation": {"max_tokens": 3}},
        {"name": "more", "prompt_template": "More on {word.generated_text}.", "limit": 2},
    ]
    preset = tmp_path / "p.yaml"
    model = str(MEDIA.parent / "models" / "tiny-lm")
    preset.write_text(yaml.safe_dump({"model": model, "generation": {"max_tokens": 3}, "stages": stages}))
    out = tmp_path / "out.parquet"
    code, said = run_cli("run", str(job), "-o", str(out), "--config", str(preset), "--require-complete")
    assert code == 4 and "incomplete: 2 of 4 rows, 2 pending" in said, said
    rows = read(out)
    assert len(rows) == 2 and all(r["dropped_at"] is None and r["more.status"] == "ok" for r in rows)
    assert About.of(pq.read_schema(out).metadata).standing == Standing(complete=False, job_rows=4, pending=2)
    code, said = run_cli("status", str(out))
    assert code == 4 and "out.parquet: incomplete · 2 of 4 rows, 2 pending" in said, said


def test_caption_then_score_and_keep_on_the_command_line(tmp_path):
    """`batchgen caption DIR --then-score Q --keep-if RULE`: the captions, then Q about each
    picture with its caption in it, scored Yes/No; the rows the rule keeps went on, the others
    stopped at the score (`score` is P(Yes), `{caption}` the caption)."""
    folder, out = tmp_path / "pictures", tmp_path / "out.parquet"
    code, output = _caption_then_score(folder, out, "score > 0.5", "--max-tokens", "8")
    assert code == 0, output
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 3 and all(r["caption.status"] == r["score.status"] == "ok" for r in rows)
    for r in rows:
        yes = next(c["prob"] for c in r["score.choice_scores"] if c["choice"] == "Yes")
        assert r["dropped_at"] == (None if yes > 0.5 else "score"), r
    job = pq.read_table(tmp_path / "out.parquet.stages" / "02-score.job.parquet").to_pylist()
    assert all(j["caption"] == j["caption.generated_text"] for j in job)  # {caption}: the caption
    code, output = run_cli(
        "caption",
        str(folder),
        "-o",
        str(tmp_path / "o2.parquet"),
        "-p",
        "x",
        "--model",
        str(MEDIA.parent / "models" / "shapes-vlm"),
        "--keep-if",
        "score > 0.5",
    )
    assert code == 2 and "--keep-if needs --then-score" in output


def test_export_a_stage_of_a_staged_output_for_the_rows_kept(tmp_path):
    """`export --stage caption`: the caption stage's answers as caption files, for the pictures
    the job kept to the end only; a staged output without --stage is a clear error."""
    folder, out = tmp_path / "pictures", tmp_path / "out.parquet"
    code, output = _caption_then_score(folder, out, '"red" in image')
    assert code == 0, output
    kept = [r for r in pq.read_table(out).to_pylist() if r["dropped_at"] is None]
    assert [Path(r["image"]).name for r in kept] == ["red_circle.png"]
    code, output = run_cli("export", str(out), "--format", "txt")
    assert code == 2 and "a staged job's output: give --stage, one of caption, score" in output, output
    code, output = run_cli("export", str(out), "--format", "txt", "--stage", "caption")
    assert code == 0, output
    assert sorted(p.name for p in folder.glob("*.txt")) == ["red_circle.txt"]
    assert (folder / "red_circle.txt").read_text() == kept[0]["caption.generated_text"] + "\n"


def _caption_then_score(folder: Path, out: Path, keep_if: str, *flags: str) -> tuple[int, str]:
    """`batchgen caption` of the sample pictures (copied into `folder`), then a VQAScore of
    each caption and `keep_if`."""
    folder.mkdir()
    for name in PICTURES:
        shutil.copy(MEDIA / name, folder / name)
    question = 'Does this figure show "{caption}"? Please answer yes or no.'
    model = str(MEDIA.parent / "models" / "shapes-vlm")
    return run_cli(
        "caption",
        str(folder),
        "-o",
        str(out),
        "-p",
        "Describe it.",
        "--model",
        model,
        "--then-score",
        question,
        "--keep-if",
        keep_if,
        "-q",
        *flags,
    )


def test_status_inspect_report_and_plan_read_a_staged_job(tmp_path):
    """The tools that read a run read a staged job as one: the output has the job's `status`
    (a stage's failure named `stage.error_stage`) and a stats file; `status` and `inspect` show
    each stage under the job; the gallery puts a row's stages on its card and marks where the
    keep_if stopped it; `plan` plans every stage, the later ones as a range that holds the run."""
    job = _job(tmp_path)
    with job.open("a") as f:
        f.write(json.dumps({"id": "gone", "image": "media/missing.png", "note": "x"}) + "\n")
    stages = [
        {"name": "caption", "prompt_template": CAPTION, "generation": {"max_tokens": 6}},
        {
            "name": "score",
            "prompt_template": SCORE,
            "generation": {"choices_to_score": ["yes", "no"], "score_only": True},
            "keep_if": '"red" in image',
        },
        {"name": "tags", "prompt_template": "Tags: {caption}", "generation": {"max_tokens": 4}},
    ]
    preset = _shapes_preset(tmp_path, stages)
    out = tmp_path / "out.parquet"
    args = (str(job), "-o", str(out), "--config", str(preset))
    code, planned = run_cli("plan", *args, "--json")
    assert code == 0, planned
    code, said = run_cli("plan", *args, "--calibrate", "2")
    assert code == 2 and "a staged job's stages are planned without it" in said, said
    code, output = run_cli("run", *args, "-q")
    assert code == 1, output  # the missing picture's row failed
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["gone"]["status"] == "error" and rows["gone"]["error_stage"] == "caption.fetch"
    assert rows["gone"]["dropped_at"] == "caption" and "missing.png" in rows["gone"]["error"]
    kept = sorted(i for i, r in rows.items() if r["dropped_at"] is None)
    assert kept == ["p0", "p3"] and all(rows[i]["status"] == "ok" for i in rows if i != "gone")

    code, said = run_cli("status", str(out))
    assert code == 1, said  # complete, one row failed
    assert "out.parquet: complete · 7 rows: 6 ok, 1 failed (caption.fetch 1)" in said
    for line in ("stage 1 caption: complete · 7 rows: 6 ok, 1 failed", "stage 2 score: complete · 6 rows"):
        assert line in said, said
    assert "stage 3 tags: complete · 2 rows: 2 ok" in said

    code, said = run_cli("inspect", str(out))
    assert code == 0, said
    assert "stages: 2 rows went through every stage, 4 stopped at score, 1 stopped at caption" in said
    assert said.index("stage 1 caption:") < said.index("stage 2 score:") < said.index("stage 3 tags:")
    assert "  scores: 'yes' prob over 6 rows" in said and "caption.fetch" in said

    page = tmp_path / "page.html"
    code, said = run_cli("report", str(out), "-o", str(page))
    assert code == 0, said
    cards = json.loads(page.read_text().split('type="application/json">')[1].split("</script>")[0])["cards"]
    entries = {(e["id"], e["stage"]): e for c in cards for e in c["entries"]}
    assert [e["stage"] for e in (entries[("p0", s)] for s in ("caption", "score", "tags"))] == [
        "caption",
        "score",
        "tags",
    ]
    assert entries[("p1", "score")]["stopped"] and not entries[("p0", "score")]["stopped"]
    assert entries[("p1", "caption")]["text"] in entries[("p1", "score")]["question"]

    plans = {s["name"]: s for s in json.loads(planned)["stages"]}
    assert plans["caption"]["rows"] == plans["score"]["rows"] == [6, 6]  # one of 7 fails to fetch
    assert plans["tags"]["rows"] == [0, 6]  # the score's keep_if decides
    folder = tmp_path / "out.parquet.stages"
    for number, name in enumerate(("caption", "score", "tags"), 1):
        ran = json.loads((folder / f"0{number}-{name}.parquet.stats.json").read_text())["prompt_tokens"]
        low, high = plans[name]["prompt_tokens"]
        assert low <= ran <= high, (name, low, ran, high)
    assert plans["score"]["prompt_tokens"][1] - plans["score"]["prompt_tokens"][0] == 6 * 6  # captions quoted

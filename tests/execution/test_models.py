"""Several models in one job (--models): rows name theirs in a `model` field (an OpenAI Batch
line in its body), each model loads once, one at a time, and each row equals its model's own
run; a name not in the set is that row's error naming the set."""

from __future__ import annotations

import json

from conftest import MEDIA, MODELS, read, run_cli, write_jsonl

PROMPTS = ["Tell me about the sea.", "Name a colour.", "Hi!", "Count to five."]


def _run(tmp_path, name, rows, *flags):
    job = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--temperature", "0", "--max-tokens", "8", *flags)
    return code, output, out


def test_rows_naming_two_models_each_equal_that_models_own_run(tmp_path, sensitive_qwen3_vl):
    """Text rows on a text model and image rows on a VLM, interleaved in the job: two loads, and
    each row as a run of its model alone gives it."""
    lm, vlm = str(MODELS / "tiny-lm"), sensitive_qwen3_vl
    pictures = ["red_circle.png", "blue_square.webp"]
    rows = []
    for i, prompt in enumerate(PROMPTS):
        rows.append({"id": f"t{i}", "prompt": prompt, "model": "writer"})
        rows.append(
            {"id": f"v{i}", "prompt": prompt, "image": str(MEDIA / pictures[i % 2]), "model": "looker"}
        )
    rows.append({"id": "default", "prompt": "Say something."})  # no model named: --model's
    rows.append({"id": "unknown", "prompt": "Hi", "model": "painter"})
    flags = ("--models", f"writer={lm},looker={vlm}", "--model", "writer")
    code, output = run_cli("plan", str(write_jsonl(tmp_path / "mixed.jsonl", rows)), *flags)
    assert code == 0, output
    assert "models: writer 5, looker 4, painter 1" in output and "lanes: lm 5, vlm 4" in output, output
    code, output, out = _run(tmp_path, "mixed", rows, *flags)
    assert code == 1, output  # the unknown model's row failed
    assert "2 model loads" in output and "models writer, looker (rows naming none: writer)" in output, output
    code, output = run_cli("status", str(out))
    assert f"model {lm}: 6 rows, 5 ok, 1 failed" in output and f"model {vlm}: 4 rows, 4 ok" in output, output
    code, output = run_cli("inspect", str(out))
    assert f"by model: tiny-lm 6 (5 ok), {vlm.name} 4 (4 ok)" in output, output
    got = {r["id"]: r for r in read(out)}
    assert got["unknown"]["error_stage"] == "read"
    assert "model 'painter' is not one of --models (writer, looker)" in got["unknown"]["error"]
    assert got["t0"]["model"] == got["default"]["model"] != got["v0"]["model"]

    for model, ids in ((lm, ["t0", "t1", "t2", "t3", "default"]), (vlm, ["v0", "v1", "v2", "v3"])):
        alone = [{k: v for k, v in r.items() if k != "model"} for r in rows if r["id"] in ids]
        code, output, own = _run(tmp_path, f"alone-{len(ids)}", alone, "--model", model)
        assert code == 0, output
        for r in read(own):
            mixed = got[r["id"]]
            assert mixed["generated_text"] == r["generated_text"], r["id"]
            assert mixed["completion_tokens"] == r["completion_tokens"], r["id"]
    assert len({got[f"v{i}"]["generated_text"] for i in range(4)}) > 1  # the VLM sees its pictures


def test_an_openai_batch_lines_model_picks_the_model_and_the_rerun_resumes(tmp_path):
    """Without --models a Batch line's body.model is said and not used; with them it picks the
    row's model, and one that is not in the set is that row's error. A rerun has nothing left."""
    lm = str(MODELS / "tiny-lm")
    bodies = [
        {"model": name, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 4}
        for i, name in enumerate(["small", "large", "gpt-4o-mini"])
    ]
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate(bodies)
    ]
    code, output, out = _run(tmp_path, "batch", lines, "--models", f"small={lm},large={MODELS / 'tiny-vlm'}")
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert got["r0"]["status"] == got["r1"]["status"] == "ok"
    assert got["r0"]["model"] != got["r1"]["model"]
    assert "model 'gpt-4o-mini' is not one of --models (small, large)" in got["r2"]["error"]
    assert "body.model" not in output
    code, output, out = _run(tmp_path, "batch", lines, "--models", f"small={lm},large={MODELS / 'tiny-vlm'}")
    assert "3 resumed" in output or "2 resumed" in output, output


def test_a_model_set_refuses_what_pairs_with_one_model(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "Hi", "model": "a"}])
    out = tmp_path / "out.parquet"
    lm = str(MODELS / "tiny-lm")
    cases = [
        (("--models", f"a={lm}", "--draft-model", lm), "--models with --draft-model"),
        (("--models", f"a={lm}", "--text-model", lm), "--models with --text-model"),
        (("--models", f"a={lm},a={lm}"), "'a' given twice"),
        (("--models", f"a b={lm}"), "expected name=PATH"),
        (("--models", f"a={lm},b={tmp_path / 'nothing'}"), "nothing"),
    ]
    for flags, message in cases:
        code, output = run_cli("run", str(job), "-o", str(out), "-q", *flags)
        assert code == 2 and message in output, (flags, output)
        assert not out.exists()


def test_a_rows_model_field_is_data_without_a_model_set(tmp_path):
    """A dataset's own `model` column (which model wrote a response) is carried, not read."""
    rows = [{"id": 1, "prompt": "Hi", "model": "gpt-4"}]
    code, output, out = _run(tmp_path, "data", rows, "--model", str(MODELS / "tiny-lm"))
    assert code == 0, output
    (row,) = read(out)
    assert row["input_model"] == "gpt-4" and row["status"] == "ok"
    assert json.dumps(row["model"]).endswith('tiny-lm"')


def test_a_hub_checkpoint_is_inspected_without_its_weights(tmp_path, monkeypatch):
    """A model given as a hub id: inspecting it (what a Ray driver does, which loads nothing)
    fetches the files that describe it, never its weights; loading it fetches them. The hub is
    a folder here: the snapshot copies what each call's patterns allow of tiny-lm."""
    import fnmatch
    import shutil

    import mlx_vlm.utils

    from batchgen.generate.base.models import inspect_model

    asked: list[list[str] | None] = []
    snapshot = tmp_path / "hub" / "tiny-lm"

    def snapshot_download(repo_id, revision=None, allow_patterns=None, force_download=False):
        asked.append(allow_patterns)
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in (MODELS / "tiny-lm").iterdir():
            if allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(mlx_vlm.utils, "snapshot_download", snapshot_download)
    info = inspect_model("someone/tiny-lm")
    assert not info.multimodal and len(asked) == 1 and "*.safetensors" not in asked[0], asked
    assert (snapshot / "config.json").is_file() and not list(snapshot.glob("*.safetensors"))
    code, output, out = _run(tmp_path, "hub", [{"id": 1, "prompt": PROMPTS[0]}], "--model", "someone/tiny-lm")
    assert code == 0, output
    assert "*.safetensors" in asked[-1] and list(snapshot.glob("*.safetensors"))
    (row,) = read(out)
    assert row["status"] == "ok" and row["completion_tokens"] > 0

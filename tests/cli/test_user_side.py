"""The user's side: caption over folders, CSV and prompt templates, OpenAI Batch files both
ways, `inspect`, and the HTML gallery in a real headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from conftest import MEDIA, MODELS, ROOT, SAMPLE, STAMP, read, run_cli, write_jsonl

sys.path.insert(0, str(ROOT / "scripts"))

import random  # noqa: E402

import train_shapes_captioner as shapes  # noqa: E402

CAPTIONER = str(MODELS / "shapes-vlm")
QUIET = ("--temperature", "0", "--max-tokens", "6", "-q")


def _folder(tmp_path):
    folder = tmp_path / "photos"
    (folder / "more").mkdir(parents=True)
    rng = random.Random(5)
    for shape, colour in [("circle", "red"), ("square", "blue")]:
        shapes.draw(shape, colour, rng).save(folder / f"{colour}_{shape}.png")
    shapes.draw("star", "yellow", rng).save(folder / "more" / "yellow_star.jpg")
    shutil.copy(MEDIA / "moving_dot.mp4", folder / "more" / "clip.mp4")
    (folder / "notes.txt").write_text("not media")
    return folder


def test_caption_folders_resume_and_pick_up_new_files(tmp_path):
    folder = _folder(tmp_path)
    out = tmp_path / "captions.parquet"
    prompts = ("--prompt", "What shape is this?", "--prompt", "What colour is the shape?")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *prompts, *QUIET)
    assert code == 0, output
    first = read(out)
    assert len(first) == 4 * 2  # files x prompts; the .txt is not media
    ids = [r["id"] for r in first]
    assert ids == sorted(ids) and "photos/more/clip.mp4#1" in ids and "photos/red_circle.png#0" in ids
    answers = {r["id"]: r["generated_text"].strip() for r in first}
    assert answers["photos/red_circle.png#0"] == "circle" and answers["photos/blue_square.png#1"] == "blue"

    shapes.draw("triangle", "green", random.Random(6)).save(folder / "green_triangle.png")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *prompts, *QUIET)
    assert code == 0 and "(8 resumed)" in output, output
    again = read(out)
    assert len(again) == 10 and [r for r in again if r["id"] in ids] == first
    assert {r["id"] for r in again} - set(ids) == {
        "photos/green_triangle.png#0",
        "photos/green_triangle.png#1",
    }


def test_caption_walks_symlink_loops_once_and_a_non_utf8_name_is_that_rows_error(tmp_path):
    import os

    folder = tmp_path / "g"
    (folder / "a").mkdir(parents=True)
    shutil.copy(MEDIA / "red_circle.png", folder / "a" / "red.png")
    (folder / "a" / "self").symlink_to(".")
    (folder / "a" / "up").symlink_to("..")
    shutil.copy(MEDIA / "red_circle.png", os.fsencode(folder) + b"/caf\xe9.png")  # not UTF-8
    out = tmp_path / "captions.parquet"
    result = subprocess.run(
        [sys.executable, "-m", "batchgen", "caption", f"{folder}/**/*.png", "-o", str(out),
         "--model", CAPTIONER, "-p", "What shape is this?", *QUIET],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    rows = {r["id"]: r for r in read(out)}
    assert len(rows) == 2  # each file once, however many links lead to it
    good = next(r for i, r in rows.items() if i.endswith("a/red.png#0"))
    bad = next(r for i, r in rows.items() if "caf" in i)
    assert good["status"] == "ok" and good["generated_text"].strip() == "circle"
    assert (bad["status"], bad["error_stage"]) == ("error", "read") and "lone surrogate" in bad["error"]


def test_csv_jobs_and_prompt_templates(tmp_path):
    rng = random.Random(7)
    shapes.draw("star", "white", rng).save(tmp_path / "star.png")
    (tmp_path / "jobs.csv").write_text(
        "id,image,title,max_tokens\n"
        "a,star.png,a star,6\n"
        "b,star.png,,6\n"  # an empty title fills in as nothing
        "c,star.png,the same star,oops\n"
    )
    out = tmp_path / "out.parquet"
    code, _ = run_cli("run", str(tmp_path / "jobs.csv"), "-o", str(out), "--model", CAPTIONER,
                      "--prompt-template", "What shape is this?{title:.0}", *QUIET)  # fmt: skip
    assert code == 1
    a, b, c = read(out)
    assert a["generated_text"].strip() == b["generated_text"].strip() == "star"
    assert c["error_stage"] == "read" and "max_tokens" in c["error"]
    # A template naming a column no row has stops the run before any work, listing the columns.
    code, output = run_cli("run", str(tmp_path / "jobs.csv"), "-o", str(tmp_path / "missing.parquet"),
                           "--model", CAPTIONER, "--prompt-template", "Describe {colour}",
                           *QUIET)  # fmt: skip
    assert (
        code == 2
        and "no column --prompt-template 'colour'; its columns: id, image, title, max_tokens" in output
    )
    assert not (tmp_path / "missing.parquet").exists()
    code, output = run_cli("run", str(tmp_path / "jobs.csv"), "-o", str(tmp_path / "bad.parquet"),
                           "--model", CAPTIONER, "--prompt-template", "Describe {title", *QUIET)  # fmt: skip
    assert code == 2 and "--prompt-template 'Describe {title': malformed" in output


def test_openai_batch_round_trip(tmp_path):
    png = base64.b64encode((MEDIA / "red_circle.png").read_bytes()).decode()
    requests = [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "max_tokens": 5, "messages": [
             {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "max_completion_tokens": 5, "temperature": 0, "messages": [
             {"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                 {"type": "text", "text": "What shape is this?"}]}]}},
        {"custom_id": "req-3", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]  # fmt: skip
    job = tmp_path / "batch.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "batch_output.jsonl"
    code, output = run_cli("run", str(job), "-o", str(out), "--output-format", "openai", "--model", CAPTIONER,
                           "--text-model", str(MODELS / "tiny-lm"), "-q")  # fmt: skip
    assert code == 1, output
    assert output.count("body.model 'gpt-4o-mini' is not used: the rows run on") == 1, output
    assert "looks like media" not in output  # a Batch line's `url` is its endpoint
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["req-1", "req-2", "req-3"]
    for line in lines[:2]:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and len(body["choices"]) == 1
        assert body["choices"][0]["message"]["role"] == "assistant"
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert lines[0]["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert lines[1]["response"]["body"]["choices"][0]["message"]["content"].strip() == "circle"
    assert lines[2]["response"] is None and lines[2]["error"]["code"] == "read_error"
    # One clear message for another endpoint, not followed by what its body lacks.
    assert (
        lines[2]["error"]["message"]
        == "url: only /v1/chat/completions requests are supported, got '/v1/embeddings'"
    )
    assert (tmp_path / "batch_output.parquet").exists()  # the resumable state beside it


def test_openai_batch_fields_are_honoured_or_refused_never_ignored(tmp_path):
    """`n` gives n completions (seeded draws differ and repeat), frequency_penalty and
    logit_bias reach the engine as mlx-lm applies them; a field batchgen cannot honour is that
    line's error naming it."""
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    def request(custom_id, **body):
        messages = [{"role": "user", "content": "Say something about cats and cats."}]
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "max_tokens": 8, "messages": messages, **body}}  # fmt: skip

    requests = [
        request("greedy-n", n=2, temperature=0),
        request("sampled-n", n=3, temperature=1.5, seed=7),
        request("penalised", temperature=0, frequency_penalty=1.5, logit_bias={"5": -100}),
        request("logprobs", logprobs=True),
        request("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        request("plain", temperature=0, stream=False, user="someone", response_format={"type": "text"}),
    ]
    job = tmp_path / "batch.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in requests))
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        code, output = run_cli("run", str(job), "-o", str(out), "--output-format", "openai", "--model",
                               str(MODELS / "tiny-lm"), "-q")  # fmt: skip
        assert code == 1, output
        outputs.append({line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())})
    lines = outputs[0]

    def texts(custom_id):
        return [c["message"]["content"] for c in lines[custom_id]["response"]["body"]["choices"]]

    assert len(set(texts("greedy-n"))) == 1 and texts("greedy-n")[0] == texts("plain")[0]
    sampled = texts("sampled-n")
    assert len(sampled) == 3 and len(set(sampled)) > 1  # seed, seed + 1, seed + 2
    assert sampled == [
        c["message"]["content"] for c in outputs[1]["sampled-n"]["response"]["body"]["choices"]
    ]
    usage = lines["greedy-n"]["response"]["body"]["usage"]
    assert usage["completion_tokens"] == 2 * lines["plain"]["response"]["body"]["usage"]["completion_tokens"]

    model, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    tokenizer.add_eos_token("<|im_end|>")
    question = [{"role": "user", "content": "Say something about cats and cats."}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    processors = make_logits_processors(logit_bias={5: -100}, frequency_penalty=1.5)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=8,
                                                      logits_processors=processors)]  # fmt: skip
    tokens = tokens[:-1] if tokens[-1] in tokenizer.eos_token_ids else tokens
    assert texts("penalised") == [tokenizer.decode(tokens)] and texts("penalised") != texts("plain")

    assert lines["logprobs"]["error"] is None  # honoured now: each token's logprob
    body = lines["logprobs"]["response"]["body"]
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    refused = "the row has tools, but the model's chat template never shows them"  # taken, then refused
    assert lines["tools"]["error"] == {"code": "generate_error", "message": refused}
    assert lines["plain"]["error"] is None


def test_inspect_counts(tmp_path):
    from batchgen.core.records import Generation, Result
    from batchgen.input.read import JobIndex, Rows
    from batchgen.output.write import SingleFile, WriteOptions

    out = tmp_path / "r.parquet"
    w = SingleFile(
        out, JobIndex("jsonl", Rows(list("abcde")), None), {}, WriteOptions(flush_rows=10, flush_seconds=3600)
    )
    w.open()
    made = {"text": "x", "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 4}
    w.add({}, Result(id="a", generation=Generation(**made, cached_tokens=6), generate_ms=50))
    w.add({}, Result(id="b", generation=Generation(**made, mtp_drafts=8, mtp_accepted=6), generate_ms=900))
    for i in "cd":
        w.add(
            {},
            Result(id=i, status="error", error=f"http://x/{i}.png: HTTP 404 Not Found", error_stage="fetch"),
        )
    w.add({}, Result(id="e", status="error", error="corrupt image", error_stage="decode"))
    w.finalize()
    code, text = run_cli("inspect", str(out))
    assert code == 0
    assert "5 rows, 2 ok, 3 failed" in text
    assert re.search(r"\n  fetch +2\n +2 × HTTP 404 Not Found\n", text)
    assert re.search(r"\n  decode +1\n +1 × corrupt image\n", text)
    assert "tokens: 20 prompt, 8 completion" in text
    assert "cache: 1 of 2 rows reused a prefix (50% of rows), 6 prompt tokens saved" in text
    assert "drafts: 6/8 accepted (75%)" in text
    assert text.index("  b: 900 ms") < text.index("  a: 50 ms")


def _browser(tmp_path):
    return ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]  # fmt: skip


def _dom_counts(page, tmp_path) -> dict[str, int]:
    """The page as headless Chromium renders it: the data-* counts its script sets on <body>."""
    dom = subprocess.run([*_browser(tmp_path), "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    body = dom.stdout[dom.stdout.index("<body") : dom.stdout.index(">", dom.stdout.index("<body"))]
    attrs = dict(part.split("=", 1) for part in body.split()[1:])
    return {k: int(v.strip('"')) for k, v in attrs.items() if k.startswith("data-")}


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_readme_results_gallery_shows_every_picture_wherever_it_is_written(tmp_path, monkeypatch):
    """The README's run and report, the results written away from sample_data/: the job's
    relative paths start where the run recorded them, images inside messages show, template
    rows show their question, failed rows show no token counts."""
    monkeypatch.chdir(tmp_path)
    job = SAMPLE / "jobs.jsonl"
    results = tmp_path / "out" / "results.parquet"
    code, output = run_cli("run", str(job), "-o", str(results), "--max-tokens", "4", "-q")
    assert code == 0, output
    page = tmp_path / "gallery.html"
    code, output = run_cli("report", str(results), "-o", str(page))
    assert code == 0 and "warning" not in output, output
    rows = [json.loads(line) for line in job.read_text().splitlines()]

    def pictures_of(r):
        flat = r["image"] if isinstance(r.get("image"), list) else [r["image"]] if r.get("image") else []
        return flat + [p["image_url"] for m in r.get("messages", []) if isinstance(m["content"], list)
                       for p in m["content"] if p.get("type") == "image_url"]  # fmt: skip

    # One card per picture (or set of them, or clip) with all its questions; a text row its own.
    groups = {json.dumps([pictures_of(r), r.get("video")]) for r in rows if pictures_of(r) or r.get("video")}
    alone = sum(not pictures_of(r) and not r.get("video") for r in rows)
    pictures = sum(len(json.loads(g)[0]) for g in groups)
    attrs = _dom_counts(page, tmp_path)
    frames = attrs["data-images"] - pictures
    assert attrs["data-cards"] == len(groups) + alone < len(rows) and frames >= 2  # each picture once
    assert attrs["data-loaded"] == attrs["data-images"]
    # A card of several rows names each row above its question: whose answer and score it shows.
    sizes = Counter(
        json.dumps([pictures_of(r), r.get("video")]) for r in rows if pictures_of(r) or r.get("video")
    )
    assert attrs["data-row-ids"] == sum(n for n in sizes.values() if n > 1) > 0

    template_rows = [{"id": "t", "image": str(MEDIA / "red_circle.png"), "title": "a red thing"},
                     {"id": "bad", "image": "nope.png", "title": "x"}]  # fmt: skip
    template_job = write_jsonl(tmp_path / "t.jsonl", template_rows)
    out = tmp_path / "t.parquet"
    run_cli("run", str(template_job), "-o", str(out), "--prompt-template", "Describe {title}.", *QUIET)
    code, output = run_cli("report", str(out), "-o", str(tmp_path / "t.html"))
    assert "warning: 1 media not found, unreadable or refused: nope.png" in output
    text = (tmp_path / "t.html").read_text()
    assert '"question": "Describe a red thing."' in text
    assert '"metrics": "0+0 tokens' not in text and "overflow-wrap:anywhere" in text


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_gallery_in_headless_chromium(tmp_path):
    _folder(tmp_path)
    names = ["red_circle.png", "blue_square.png", "more/yellow_star.jpg"]
    rows = [
        {"id": f"r{i}", "image": f"photos/{name}", "prompt": "What shape is this?"}
        for i, name in enumerate(names)
    ]
    rows.append({"id": "v", "video": "photos/more/clip.mp4", "prompt": "What moves?"})
    rows.append({"id": "bad", "image": "photos/notes.txt", "prompt": "?"})
    job = tmp_path / "jobs.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = tmp_path / "results.parquet"
    assert run_cli("run", str(job), "-o", str(results), "--model", CAPTIONER, *QUIET)[0] == 1
    page = tmp_path / "gallery.html"
    code, output = run_cli("report", str(results), "-o", str(page))
    assert code == 0 and "5 cards" in output
    browser = _browser(tmp_path)
    attrs = _dom_counts(page, tmp_path)
    assert attrs["data-cards"] == len(rows)
    assert attrs["data-images"] >= 4 and attrs["data-loaded"] == attrs["data-images"]
    assert attrs["data-failed"] == 1
    shot = [*browser, f"--screenshot={tmp_path / 'gallery.png'}", "--window-size=1200,900", page.as_uri()]
    subprocess.run(shot, capture_output=True, timeout=120)
    assert (tmp_path / "gallery.png").stat().st_size > 10_000


def _sections(command: str) -> dict[str, list[str]]:
    code, text = run_cli(command, "--help")
    assert code == 0
    heads = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["Input:", "Models:", "Generation:", "Media:", "Reuse and batching:", "Drafts:",
                     "Scale-out:", "Output and reruns:"]  # fmt: skip
    sections: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line in heads:
            current = line
        elif line.strip().startswith("-") and current:
            sections.setdefault(current, []).append(line.split()[0].rstrip(","))
    return sections


def test_run_help_comes_in_sections_and_the_top_help_names_the_formats():
    sections = _sections("run")
    assert "--image-column" in sections["Input:"] and "--max-tokens" in sections["Generation:"]
    assert (
        "--max-attempts" in sections["Output and reruns:"]
        and "--batch-size" in sections["Reuse and batching:"]
        and {"--time-limit", "--fail-on", "--require-complete", "--errors-file"}
        <= {*sections["Output and reruns:"]}
        and {"--memory-budget", "--kv-bits"} <= {*sections["Reuse and batching:"]}
    )
    caption = _sections("caption")
    assert {"-p", "--ext"} <= {*caption["Input:"]} and "--write-captions" in caption["Output and reruns:"]
    assert not any(option.startswith(("--write", "--time")) for option in caption["Generation:"])
    code, top = run_cli("--help")
    assert "CSV" in top and "OpenAI Batch" in top and "WebDataset" in top


def test_caption_over_two_folders_of_one_name_and_an_early_failure(tmp_path):
    """train/images and val/images: distinct ids; a run that stops before any work leaves no
    jobs file; `caption --help` offers no column flags (a folder has no columns)."""
    for split, (shape, colour) in (("train", ("circle", "red")), ("val", ("square", "blue"))):
        (tmp_path / split / "images").mkdir(parents=True)
        shapes.draw(shape, colour, random.Random(1)).save(tmp_path / split / "images" / "a.png")
    out = tmp_path / "c.parquet"
    folders = (str(tmp_path / "train" / "images"), str(tmp_path / "val" / "images"))
    code, output = run_cli(
        "caption", *folders, "-o", str(out), "--model", CAPTIONER, "-p", "What shape?", *QUIET
    )
    assert code == 0, output
    assert sorted(r["id"] for r in read(out)) == ["train/images/a.png#0", "val/images/a.png#0"]
    bad = tmp_path / "bad.parquet"
    code, output = run_cli("caption", *folders, "-o", str(bad), "--model", str(tmp_path / "nope"), "-p", "x")
    assert code == 2 and not (tmp_path / "bad.parquet.jobs.jsonl").exists()
    code, output = run_cli("caption", "--help")
    assert "--id-column" not in output and "--image-column" not in output
    assert output.index("PATHS") < output.index("Models:")  # the paths are input, not generation


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_three_prompt_caption_run_shows_one_card_per_image(tmp_path):
    folder = _folder(tmp_path)
    out = tmp_path / "captions.parquet"
    prompts = ("-p", "What shape is this?", "-p", "What colour is the shape?", "-p", "Describe it.")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *prompts, *QUIET)
    assert code == 0, output
    page = tmp_path / "gallery.html"
    code, output = run_cli("report", str(out), "-o", str(page))
    assert code == 0 and "4 cards" in output, output  # 3 pictures and a clip, 12 rows
    attrs = _dom_counts(page, tmp_path)
    assert attrs["data-cards"] == 4 and attrs["data-loaded"] == attrs["data-images"]
    text = page.read_text()
    assert "12 rows on 4 cards" in text and '"id": "photos/red_circle.png"' in text


def _img2dataset_shard(folder, pictures):
    """An img2dataset Parquet shard: `key`, `url`, `caption` and the picture's bytes in `jpg`."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng, blobs = random.Random(8), []
    for shape, colour in pictures:
        buf = io.BytesIO()
        shapes.draw(shape, colour, rng).save(buf, format="JPEG")
        blobs.append(buf.getvalue())
    keys = [f"{i:09d}" for i in range(len(pictures))]
    pq.write_table(pa.table({"key": keys, "url": [f"http://127.0.0.1:9/{k}.jpg" for k in keys],
                             "caption": [f"a {c} {s}" for s, c in pictures], "jpg": blobs}),
                   folder / "00000.parquet")  # fmt: skip
    return keys


def _page_data(page) -> dict:
    text = page.read_text()
    start = text.index('<script id="data" type="application/json">') + len(
        '<script id="data" type="application/json">'
    )
    return json.loads(text[start : text.index("</script>", start)])


def test_an_img2dataset_jobs_gallery_shows_its_pictures_from_the_job_or_the_kept_bytes(tmp_path):
    """The bytes are not copied to the output; the gallery reads them again from the job.
    With --keep-columns jpg they come from the output; with the job gone, the `url` column."""
    jobs = tmp_path / "shards"
    keys = _img2dataset_shard(jobs, [("circle", "red"), ("square", "blue"), ("star", "yellow")])
    out = tmp_path / "captions"
    flags = ("--id-column", "key", "--image-column", "jpg", "--model", CAPTIONER, "--prompt-template",
             "What shape is this?", *QUIET)  # fmt: skip
    code, output = run_cli("run", str(jobs), "-o", f"{out}/", *flags)
    assert code == 0 and "not copied to the output: jpg" in output, output
    import pyarrow.parquet as pq

    recorded = json.loads(pq.read_schema(out / "00000.parquet").metadata[b"batchgen.job"])
    assert recorded["not_carried"] == ["jpg"] and recorded["image"] == ["jpg"]  # what report reads again
    page = tmp_path / "gallery.html"
    code, output = run_cli("report", str(out), "-o", str(page))
    assert code == 0 and "3 cards" in output and "warning" not in output, output
    data = _page_data(page)
    assert [c["id"] for c in data["cards"]] == keys
    for card in data["cards"]:
        (key,) = card["media"]
        assert key.startswith("image:bytes ") and data["thumbs"][key][0].startswith("data:image/jpeg;base64,")
    assert len(data["thumbs"]) == 3  # three different pictures

    kept = tmp_path / "kept.parquet"
    assert run_cli("run", str(jobs), "-o", str(kept), *flags, "--keep-columns", "jpg")[0] == 0
    shutil.rmtree(jobs)  # the output carries the bytes itself
    code, output = run_cli("report", str(kept), "-o", str(tmp_path / "kept.html"))
    assert code == 0 and "3 cards" in output
    assert _page_data(tmp_path / "kept.html")["thumbs"] == data["thumbs"]  # the same thumbnails

    code, output = run_cli("report", str(out), "-o", str(tmp_path / "urls.html"))  # the job is gone
    assert code == 0, output
    urls = _page_data(tmp_path / "urls.html")["thumbs"]
    assert sorted(urls.values()) == [[f"http://127.0.0.1:9/{k}.jpg"] for k in keys]


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_an_img2dataset_jobs_gallery_shows_its_pictures_in_chromium(tmp_path):
    jobs = tmp_path / "shards"
    _img2dataset_shard(jobs, [("circle", "red"), ("square", "blue")])
    out = tmp_path / "captions.parquet"
    flags = ("--id-column", "key", "--image-column", "jpg", "--prompt-template", "What shape is this?")
    code, output = run_cli("run", str(jobs), "-o", str(out), *flags, "--model", CAPTIONER, *QUIET)
    assert code == 0, output
    page = tmp_path / "gallery.html"
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    attrs = _dom_counts(page, tmp_path)
    assert attrs["data-cards"] == 2 and attrs["data-images"] == 2 and attrs["data-loaded"] == 2


def test_a_cron_log_has_times_a_start_line_and_as_much_detail_as_asked(tmp_path, scripted):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(5)])
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--model", CAPTIONER, "--limit", "2")
    assert code == 0, output
    where = f"{re.escape(str(job))} → {re.escape(str(out))}"
    start = re.search(rf"^{STAMP} INFO start: {where} · 5 rows, 2 to do · model {re.escape(CAPTIONER)} · "
                      "engine local$", output, re.M)  # fmt: skip
    assert start, output
    assert "DEBUG" not in output and "TRACE" not in output
    code, output = run_cli("-v", "run", str(job), "-o", str(out), "--model", CAPTIONER)
    assert re.search(rf"^{STAMP} INFO resuming: 2 of 5 rows done$", output, re.M), output
    assert re.search(rf"^{STAMP} DEBUG window: 3 rows \(0 with media", output, re.M)
    assert re.search(rf"^{STAMP} DEBUG lane scripted: 3 rows", output, re.M) and "TRACE" not in output
    code, output = run_cli("-vv", "run", str(job), "-o", str(out), "--model", CAPTIONER, "--overwrite")
    assert len(re.findall(rf"^{STAMP} TRACE row line \d \(id 'r\d'\): ok, ", output, re.M)) == 5, output
    code, output = run_cli("run", str(job), "-o", str(out), "--model", CAPTIONER, "--overwrite", "-q")
    # -q: no start or progress lines; the closing lines, stamped like the rest
    assert code == 0 and "INFO start" not in output, output
    assert [re.sub(rf"^{STAMP} ", "", line)[:17] for line in output.splitlines()] == [
        "INFO 5 rows: 5 ok",
        f"INFO wrote {str(out)[:6]}",
    ]


def test_environment_variables_are_named_after_the_flags_and_a_typo_is_named(tmp_path, monkeypatch):
    folder = tmp_path / "photos"
    folder.mkdir()
    shapes.draw("circle", "red", random.Random(1)).save(folder / "a.png")
    out = tmp_path / "c.parquet"
    monkeypatch.setenv("BATCHGEN_CAPTION_PROMPT", "What shape is this?")  # one prompt, spaces and all
    monkeypatch.setenv("BATCHGEN_RUN_TEMPRATURE", "0")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *QUIET)
    assert code == 0, output
    assert [r["prompt"] for r in read(out)] == ["What shape is this?"]
    assert ("warning: BATCHGEN_RUN_TEMPRATURE is not a batchgen variable and is ignored; did you mean "
            "BATCHGEN_RUN_TEMPERATURE?") in output  # fmt: skip
    monkeypatch.delenv("BATCHGEN_RUN_TEMPRATURE")
    monkeypatch.setenv("BATCHGEN_CAPTION_PROMPT", "What shape is this?\nWhat colour is the shape?\n")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, *QUIET)
    assert code == 0 and "warning" not in output, output
    assert sorted(r["prompt"] for r in read(out)) == ["What colour is the shape?", "What shape is this?"]
    monkeypatch.setenv("BATCHGEN_CAPTION_MAX_TOKENS", "many")
    code, output = run_cli("caption", str(folder), "-o", str(out), "--model", CAPTIONER, "-q")
    assert code == 2 and "(from the environment variable BATCHGEN_CAPTION_MAX_TOKENS)" in output


def test_env_says_the_backend_the_versions_and_the_blas(monkeypatch):
    import importlib.metadata

    code, output = run_cli("env")
    assert code == 0, output
    assert re.search(r"^mlx backend: (cpu|metal|cuda), default device Device\(", output, re.M)
    budget = re.search(r"^memory budget \(--memory-budget auto\): [\d.]+ [GMK]iB, (.+)$", output, re.M)
    assert budget and ("RAM (CPU backend)" in budget[1] or "Metal" in budget[1] or "GPU" in budget[1])
    assert f"\nmlx: {importlib.metadata.version('mlx')}\n" in output
    assert f"\nmlx-vlm: {importlib.metadata.version('mlx-vlm')}\n" in output
    if sys.platform.startswith("linux") and "backend: cpu" in output:
        assert re.search(r"^blas: .*blas", output, re.M)
        if "(the reference BLAS" in output and "faster blas installed" in output:
            assert "LD_PRELOAD=" in output and "OPENBLAS_NUM_THREADS=1" in output


def test_run_wide_scoring_shows_in_inspect_and_the_gallery(tmp_path):
    rows = [{"id": f"r{k}", "prompt": f"Is {k} even?"} for k in range(3)]
    rows.append({"id": "bad", "prompt": "x", "choices_to_score": "Yes"})
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    scoring = ("--choices-to-score", "Yes", "--choices-to-score", "No", "--score-only")
    model = ("--model", str(MODELS / "tiny-lm"))
    code, output = run_cli("run", str(job), "-o", str(out), *model, "-q", *scoring)
    assert code == 1, output  # the bad row
    got = {r["id"]: r for r in read(out)}
    assert [c["choice"] for c in got["r0"]["choice_scores"]] == ["Yes", "No"]
    assert got["r0"]["finish_reason"] == "score" and got["r0"]["completion_tokens"] == 0
    assert "choices_to_score: expected up to 64 non-empty strings, got 'Yes'" in got["bad"]["error"]
    text = run_cli("inspect", str(out))[1]
    assert "scores: 'Yes' prob over 3 rows: mean" in text and "scores: 'No' prob over 3 rows" in text
    page = tmp_path / "gallery.html"
    assert run_cli("report", str(out), "-o", str(page))[0] == 0
    cards = {c["id"]: c for c in _page_data(page)["cards"]}
    assert cards["r0"]["score"] == got["r0"]["choice_scores"][0]["prob"]
    assert cards["r0"]["entries"][0]["scores"].startswith("Yes 0.") and 'id="byscore"' in page.read_text()

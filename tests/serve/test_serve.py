"""`batchgen serve` as a Batch client sees it: a real server process on loopback, driven by the
official `openai` package unchanged but for base_url and api_key."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import MODELS, read, run_cli
from openai.types.chat import ChatCompletion

KEY = "sk-test-batchgen"
LM = str(MODELS / "tiny-lm")
ENDED = ("completed", "failed", "expired", "cancelled")


def _http(url: str, key: str | None = None, basic: bool = False, body: bytes | None = None, **headers: str):
    """(status, text) of a plain request: the page, or what no client library would send."""
    if key is not None:
        token = base64.b64encode(f"anyone:{key}".encode()).decode() if basic else key
        headers["Authorization"] = f"{'Basic' if basic else 'Bearer'} {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`batchgen serve` in a subprocess, up once its status page answers."""

    def __init__(self, data: Path, *flags: str, key: str | None = KEY):
        self.data, self.port = data, _port()
        self.clients: list[openai.OpenAI] = []
        self.url = f"http://127.0.0.1:{self.port}"
        auth = ("--api-key", key) if key else ("--no-auth",)
        argv = [
            sys.executable,
            "-m",
            "batchgen",
            "serve",
            "--model",
            LM,
            "--data",
            str(data),
            "--port",
            str(self.port),
            *auth,
            *flags,
        ]
        self.log = open(data.parent / f"{data.name}-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                if _http(self.url + "/", key)[0] == 200:
                    return
            except OSError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        raise AssertionError(f"the server did not come up: {self.output()}")

    def client(self, key: str = KEY) -> openai.OpenAI:
        """A client of this server, closed with it."""
        made = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)
        self.clients.append(made)
        return made

    def output(self) -> str:
        self.log.flush()
        return (self.data.parent / f"{self.data.name}-{self.port}.log").read_text()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for made in self.clients:
            made.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "data")
    yield s
    s.stop()


def _request(custom_id: str, content, max_tokens: int = 8, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "any", "messages": messages, "max_tokens": max_tokens, **body},
    }


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _wait(client: openai.OpenAI, batch_id: str, until=ENDED, seconds: float = 120):
    for _ in range(int(seconds * 10)):
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch still {batch.status}")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_through_the_official_client_as_batchgen_run_answers_it(server, tmp_path):
    """files.create → batches.create → poll → files.content: every answer a ChatCompletion,
    the same as `batchgen run` gives the same file; a request the run refuses (a local path
    in a client's line) is in the error file, with its stage."""
    lines = [
        _request(f"r{i}", f"Tell me about {word}.", max_tokens=6 + i)
        for i, word in enumerate(["the sea", "a cat", "rain", "bread", "stars"])
    ]
    picture = [
        {"type": "image_url", "image_url": {"url": str(MODELS.parent / "media" / "red_circle.png")}},
        {"type": "text", "text": "What is it?"},
    ]
    lines.append(_request("local", picture))
    client = server.client()
    uploaded = client.files.create(file=("jobs.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "batch",
        len(_jsonl(lines)),
        "jobs.jsonl",
    )
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"night": "1"},
    )
    assert batch.status == "validating" and batch.metadata == {"night": "1"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    answered = _lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in answered) == [f"r{i}" for i in range(5)]
    failed = _lines(client, batch.error_file_id)
    assert [line["custom_id"] for line in failed] == ["local"] and failed[0]["response"] is None
    assert failed[0]["error"]["code"] == "fetch_error"
    assert "may not name this machine's files" in failed[0]["error"]["message"]
    for line in answered:
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.choices[0].message.content and line["response"]["status_code"] == 200
    # the same lines through `batchgen run` (the CLI's own OpenAI output): the same answers
    job = tmp_path / "same.jsonl"
    job.write_bytes(_jsonl(lines[:5]))
    code, output = run_cli(
        "run", str(job), "-o", str(tmp_path / "same.parquet"), "--model", LM, "-q", "--output-format", "both"
    )
    assert code == 0, output
    by_id = {r["id"]: r for r in read(tmp_path / "same.parquet")}
    for line in answered:
        body = line["response"]["body"]
        row = by_id[line["custom_id"]]
        assert body["choices"][0]["message"]["content"] == row["generated_text"]
        assert body["usage"]["completion_tokens"] == row["completion_tokens"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_a_file_that_is_not_a_batch_file_fails_validation_line_by_line(server):
    lines = [
        json.dumps(_request("a", "Hi")),
        "{not json",
        json.dumps(_request("a", "Again")),  # a duplicate id
        json.dumps({**_request("c", "Hi"), "url": "/v1/embeddings"}),
        json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
        "[" * 100_000,  # nested past the parser's recursion limit
        json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/chat/completions", "body": []}),
    ]
    client = server.client()
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _wait(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "invalid_method"),
        (6, "invalid_json_line"),
        (7, "missing_required_parameter"),
    }, batch.errors


def test_bad_requests_get_the_apis_errors(server, tmp_path):
    client = server.client()
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").batches.list()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0123")
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../state.sqlite3")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        client.batches.create(
            input_file_id="file-nothing", endpoint="/v1/chat/completions", completion_window="24h"
        )
    uploaded = client.files.create(
        file=("a.jsonl", io.BytesIO(_jsonl([_request("a", "Hi")]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="soon"
        )
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={f"k{i}": "v" for i in range(17)},
        )
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


@pytest.mark.slow  # a server process
def test_uploads_over_the_limits_are_refused_and_leave_nothing(tmp_path):
    s = Server(tmp_path / "data", "--max-file-bytes", "4096", "--max-lines", "3")
    try:
        client = s.client()
        # no key: refused before the body is read
        form = b"--b\r\nContent-Disposition: form-data; name=purpose\r\n\r\nbatch\r\n--b--\r\n"
        kind = {"Content-Type": "multipart/form-data; boundary=b"}
        status, text = _http(s.url + "/v1/files", body=form, **kind)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.APIStatusError) as big:
            client.files.create(file=("big.jsonl", io.BytesIO(b"{}\n" * 30_000)), purpose="batch")
        assert big.value.status_code == 413
        many = _jsonl([_request(f"r{i}", "Hi") for i in range(4)])
        with pytest.raises(openai.BadRequestError, match="at most 3"):
            client.files.create(file=("many.jsonl", io.BytesIO(many)), purpose="batch")
        assert list((tmp_path / "data" / "files").iterdir()) == []
        assert client.files.list().data == []
    finally:
        s.stop()


def test_no_auth_only_on_loopback(tmp_path):
    code, output = run_cli(
        "serve", "--model", LM, "--data", str(tmp_path / "d"), "--host", "0.0.0.0", "--no-auth"
    )
    assert code == 2 and "--no-auth serves anyone who can reach 0.0.0.0" in output
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "serve", "--model", LM, "--data", str(tmp_path / "d")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "an API key is needed" in done.stderr + done.stdout
    code, output = run_cli("serve", "--model", LM, "--data", str(tmp_path / "d"), "--api-key", "")
    assert code == 2 and "--api-key: at least 8 printable characters" in output  # "Bearer " would match ""


def _long_batch(client: openai.OpenAI, rows: int, tokens: int, window: str = "24h"):
    lines = [_request(f"r{i:03}", f"Story {i} about the sea.", max_tokens=tokens) for i in range(rows)]
    uploaded = client.files.create(file=("long.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window
    )


@pytest.mark.slow  # a server process and a batch run to its end
def test_cancel_keeps_the_finished_lines_and_lists_the_rest(tmp_path):
    s = Server(tmp_path / "data", "--batch-size", "4")
    try:
        client = s.client()
        batch = _long_batch(client, 48, 200)
        batch = _wait(client, batch.id, until=("in_progress",))
        for _ in range(600):
            if client.batches.retrieve(batch.id).request_counts.completed >= 4:
                break
            time.sleep(0.05)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        batch = _wait(client, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at
        answered, failed = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
        assert answered and failed and len(answered) + len(failed) == 48
        assert {line["error"]["code"] for line in failed} == {"batch_cancelled"}
        ids = sorted(line["custom_id"] for line in answered + failed)
        assert ids == [f"r{i:03}" for i in range(48)]
        assert batch.request_counts.completed == len(answered) and batch.request_counts.failed == len(failed)
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(_wait(client, _long_batch(client, 1, 1).id).id)  # a completed batch
    finally:
        s.stop()


@pytest.mark.slow  # a server process and a batch run to its end
def test_a_batch_past_its_window_expires_with_its_finished_lines(server):
    client = server.client()
    batch = _long_batch(client, 40, 200, window="2s")
    batch = _wait(client, batch.id)
    assert batch.status == "expired" and batch.expired_at, batch
    answered, failed = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    assert len(answered) + len(failed) == 40 and failed
    assert {line["error"]["code"] for line in failed} == {"batch_expired"}


@pytest.mark.slow  # two server processes, one killed mid-batch
def test_kill_9_and_start_again_the_batch_goes_on(tmp_path):
    data = tmp_path / "data"
    s = Server(data, "--batch-size", "4")
    client = s.client()
    batch = _long_batch(client, 40, 120)
    for _ in range(1200):
        seen = client.batches.retrieve(batch.id)
        if seen.request_counts.completed >= 8:
            break
        time.sleep(0.05)
    s.stop(signal.SIGKILL)
    assert seen.status == "in_progress"
    again = Server(data, "--batch-size", "4")
    try:
        client = again.client()
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 40
        ids = [line["custom_id"] for line in _lines(client, done.output_file_id)]
        assert sorted(ids) == [f"r{i:03}" for i in range(40)]  # every request once
        stats = json.loads((data / "batches" / batch.id / "output.parquet.stats.json").read_text())
        assert stats["resumed"] >= 8  # the first process's rows were kept, not generated again
        assert stats["generated"] + stats["resumed"] == 40  # ... and none of the others twice
    finally:
        again.stop()


@pytest.mark.slow  # a server process
def test_the_status_page_escapes_what_clients_send(server):
    client = server.client()
    uploaded = client.files.create(
        file=("<img src=x onerror=alert(1)>.jsonl", io.BytesIO(_jsonl([_request("a", "Hi")]))),
        purpose="batch",
    )
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"<b>": "<script>alert(1)</script>"},
    )
    _wait(client, batch.id)
    status, page = _http(server.url + "/", KEY)
    assert status == 200 and "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and batch.id in page and 'data-status="completed"' in page
    assert _http(server.url + "/")[0] == 401
    assert _http(server.url + "/", KEY, basic=True)[0] == 200  # a browser's: the key as password
    status, gallery = _http(server.url + f"/batches/{batch.id}/gallery", KEY, basic=True)
    assert status == 200 and "<html" in gallery.lower()


@pytest.mark.slow  # a server process
def test_lists_page_newest_first_and_end(server):
    client = server.client()
    ids = [
        client.files.create(
            file=(f"f{i}.jsonl", io.BytesIO(_jsonl([_request("a", "Hi")]))), purpose="batch"
        ).id
        for i in range(5)
    ]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # auto-paging ends


@pytest.mark.slow  # a server process and a batch run to its end
def test_batches_run_in_creation_order_on_a_model_loaded_once(server):
    client = server.client()
    made = [_long_batch(client, 6, 12) for _ in range(3)]
    done = [_wait(client, b.id) for b in made]
    assert [b.status for b in done] == ["completed"] * 3
    for before, after in zip(done, done[1:], strict=False):
        assert before.completed_at <= after.in_progress_at  # one after another, oldest first
    loads = []
    for b in done:
        stats = json.loads((server.data / "batches" / b.id / "output.parquet.stats.json").read_text())
        loads.append(stats["model_loads"])
    assert loads == [1, 0, 0]
    texts = [
        sorted(
            line["response"]["body"]["choices"][0]["message"]["content"]
            for line in _lines(client, b.output_file_id)
        )
        for b in done
    ]
    assert texts[0] == texts[1] == texts[2]  # the same requests, the same answers on the kept model


def _chromium(tmp_path: Path, *args: str) -> str:
    """What headless Chromium prints (--dump-dom: the page as it rendered it)."""
    browser = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    return subprocess.run([*browser, *args], capture_output=True, text=True, timeout=120).stdout


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_status_page_in_headless_chromium(tmp_path):
    """The page as a browser renders it: one row per batch with its status and a full bar for
    a finished batch, links to its files and gallery, a client's markup shown as text only."""
    s = Server(tmp_path / "data", key=None)
    try:
        client = s.client("unused")
        ok = _long_batch(client, 3, 4)
        bad = client.files.create(file=("x.jsonl", io.BytesIO(b"{oops\n")), purpose="batch")
        failed = client.batches.create(
            input_file_id=bad.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"note": "<script>alert(1)</script>"},
        )
        for b in (ok, failed):
            _wait(client, b.id)
        dom = _chromium(tmp_path, "--dump-dom", s.url + "/")
    finally:
        s.stop()
    assert 'data-batches="2"' in dom and 'data-active="0"' in dom, dom[:500]
    assert f'data-id="{ok.id}" data-status="completed"' in dom
    assert f'data-id="{failed.id}" data-status="failed"' in dom
    assert 'style="width:100%"' in dom and "line 1: this line is not valid JSON" in dom
    assert 'href="v1/files/' in dom and f'href="batches/{ok.id}/gallery"' in dom
    assert "<script" not in dom and "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


@pytest.mark.slow  # a server process
def test_without_the_key_every_endpoint_is_401_and_hostile_files_get_api_errors(tmp_path):
    """No key: 401 everywhere, the page too. A file that is not JSONL, a line over the line
    limit: the batch fails validation, saying which line. Ids that look like paths: 404. And
    nothing is written outside --data."""
    s = Server(tmp_path / "data", "--max-line-bytes", "400")
    try:
        endpoints = [
            ("GET", "/"),
            ("GET", "/v1/files"),
            ("POST", "/v1/files"),
            ("GET", "/v1/files/file-x"),
            ("DELETE", "/v1/files/file-x"),
            ("GET", "/v1/files/file-x/content"),
            ("GET", "/v1/batches"),
            ("POST", "/v1/batches"),
            ("GET", "/v1/batches/batch_x"),
            ("POST", "/v1/batches/batch_x/cancel"),
            ("GET", "/batches/batch_x/gallery"),
        ]
        for method, path in endpoints:
            request = urllib.request.Request(
                s.url + path, data=b"{}" if method == "POST" else None, method=method
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            refused.value.close()
            assert refused.value.code == 401, (method, path)
        for path in (
            "/v1/files/..%2F..%2Fetc%2Fpasswd/content",
            "/v1/files/..%2Fstate.sqlite3",
            "/v1/batches/..%2F..%2Fetc%2Fpasswd",
            "/batches/..%2F..%2Fetc/gallery",
        ):
            status, text = _http(s.url + path, KEY)
            assert status == 404 and "root:" not in text, (path, status)
        client = s.client()
        garbage = client.files.create(file=("x.bin", io.BytesIO(bytes(range(256)) * 4)), purpose="batch")
        long_line = _jsonl([_request("ok", "Hi"), _request("long", "x" * 500)])
        too_long = client.files.create(file=("long.jsonl", io.BytesIO(long_line)), purpose="batch")
        for uploaded, want in ((garbage, "invalid_json_line"), (too_long, "line_too_large")):
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch = _wait(client, batch.id)
            assert batch.status == "failed" and want in {e.code for e in batch.errors.data}, batch.errors
        assert [e.line for e in batch.errors.data] == [2]
    finally:
        s.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["data", s.log.name.rsplit("/", 1)[-1]])


@pytest.mark.slow  # headless Chromium
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_running_batch_on_the_status_page_in_chromium(tmp_path):
    """A batch's progress as the browser shows it while it runs (a screenshot taken too): its
    status, counts and share between what the batch object said just before and just after."""
    s = Server(tmp_path / "data", "--batch-size", "2", key=None)
    try:
        client = s.client("unused")
        batch = _long_batch(client, 80, 200)  # a minute of work: still running when the page is read
        for _ in range(2400):
            before = client.batches.retrieve(batch.id)
            if before.request_counts.completed >= 2:
                break
            time.sleep(0.05)
        assert before.request_counts.completed >= 2, before
        shot = tmp_path / "page.png"
        dom = _chromium(tmp_path, "--dump-dom", s.url + "/")
        after = client.batches.retrieve(batch.id)
        _chromium(tmp_path, "--window-size=1200,600", f"--screenshot={shot}", s.url + "/")
        client.batches.cancel(batch.id)
        _wait(client, batch.id)
    finally:
        s.stop()
    row = re.search(rf'<tr class="batch" data-id="{batch.id}"([^>]*)>', dom)
    assert row, dom[:800]
    shown = dict(re.findall(r'data-([a-z]+)="([^"]*)"', row.group(1)))
    assert shown["status"] == "in_progress" == before.status == after.status
    assert int(shown["total"]) == before.request_counts.total == 80
    completed = int(shown["completed"])
    assert before.request_counts.completed <= completed <= after.request_counts.completed
    assert 0 < int(shown["share"]) == int(100 * (completed + int(shown["failed"])) / 80) < 100
    assert f"{completed} done" in dom and 'http-equiv="refresh"' in dom  # it reloads itself
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


@pytest.mark.slow  # a server process and a batch run to its end
def test_the_readme_client_example_runs_as_written(tmp_path, monkeypatch, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## A local Batch API") : readme.index("## Caption a folder for training")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = re.search(r'`(\{"custom_id": "r1".*?)`', section.replace("\n", " "))
    s = Server(tmp_path / "data", key="sk-local")
    try:
        monkeypatch.chdir(tmp_path)
        request = json.loads(line.group(1))
        lines = [{**request, "custom_id": f"r{i}"} for i in range(3)]
        (tmp_path / "requests.jsonl").write_bytes(_jsonl(lines))
        namespace: dict = {}
        exec(compile(code.replace("127.0.0.1:8000", f"127.0.0.1:{s.port}"), "README", "exec"), namespace)
    finally:
        s.stop()
    assert namespace["batch"].status == "completed" and len(namespace["answers"]) == 3
    printed = capsys.readouterr().out
    assert printed.startswith("completed ") and all(f"r{i} " in printed for i in range(3))

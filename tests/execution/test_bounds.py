"""Bounds no row can escape: the model's context caps max_tokens, --row-timeout ends a row,
and a stop request ends a run within seconds whatever is generating or downloading."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import MEDIA, MODELS, batch, read, write_jsonl
from mediaserver import MediaServer


def _small_context(src, dst, context: int):
    """A copy of a tiny checkpoint whose config declares a short context (RoPE models: the
    weights do not depend on it)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = context
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["max_position_embeddings"] = context
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_max_tokens_is_capped_at_what_the_context_leaves(workdir):
    lm = _small_context(MODELS / "tiny-lm", workdir / "lm64", 64)
    vlm = _small_context(MODELS / "tiny-vlm", workdir / "vlm128", 128)
    job = write_jsonl(
        workdir / "jobs.jsonl",
        [
            {"id": "text", "prompt": "Tell me everything.", "max_tokens": 10**9},
            {"id": "video", "video": "media/moving_dot.mp4", "prompt": "And this?", "max_tokens": 10**9},
            {"id": "short", "prompt": "Hi.", "max_tokens": 3},
        ],
    )
    code, output = batch(job, workdir / "out.parquet", "--model", str(vlm), "--text-model", str(lm))
    assert code == 0, output
    rows = {r["id"]: r for r in read(workdir / "out.parquet")}
    text, video, short = rows["text"], rows["video"], rows["short"]
    assert text["finish_reason"] == "length" and text["prompt_tokens"] + text["completion_tokens"] == 64
    # The video row runs through mlx-vlm's own generate, capped the same way.
    assert video["finish_reason"] == "length" and video["prompt_tokens"] + video["completion_tokens"] == 128
    assert short["completion_tokens"] <= 3
    stats = json.loads((workdir / "out.parquet.stats.json").read_text())
    assert stats["max_tokens_capped"] == 2 and "2 rows capped at the context" in output


def test_a_row_past_row_timeout_is_a_generate_error_and_its_batch_mates_finish(tmp_path):
    job = write_jsonl(
        tmp_path / "jobs.jsonl",
        [{"id": "long", "prompt": "Go on forever.", "max_tokens": 10**9}, {"id": "quick", "prompt": "Hi."}],
    )
    t0 = time.monotonic()
    code, output = batch(job, tmp_path / "out.parquet", "--row-timeout", "1")
    assert code == 1, output
    assert time.monotonic() - t0 < 30
    rows = {r["id"]: r for r in read(tmp_path / "out.parquet")}
    assert rows["long"]["error_stage"] == "generate"
    assert "no answer within --row-timeout 1 s" in rows["long"]["error"]
    assert rows["quick"]["status"] == "ok"


def _start(job, out, *extra, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "-o", str(out), "-q",
           "--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"),
           "--temperature", "0", *extra]  # fmt: skip
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _stopped_within(proc: subprocess.Popen, seconds: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the run did not stop within {seconds} s")
    return proc.returncode, err


@pytest.mark.slow  # a subprocess stopped by signals
def test_sigterm_ends_a_long_generation_within_seconds(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Story {i}.", "max_tokens": 10**9} for i in range(4)]
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "first", "prompt": "Hi.", "max_tokens": 2}, *rows])
    out = tmp_path / "out.parquet"
    proc = _start(job, out, "--batch-size", "4")
    time.sleep(6)  # loaded and deep into the long batch (it takes a minute)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    code, err = _stopped_within(proc, 10)
    assert code == 143 and "stopped by SIGTERM" in err
    assert not out.with_name(out.name + ".lock").exists()


@pytest.mark.slow  # a subprocess stopped by signals
def test_sigterm_during_a_trickling_download_stops_at_once_and_a_second_cleans_up(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out.parquet"
    with MediaServer(MEDIA) as server:  # /trickle sends a byte every 50 ms: 20 s for the body
        write_jsonl(job, [{"id": "slow", "image": f"{server.url}/trickle", "prompt": "?"}])
        proc = _start(job, out, "--allow-private-urls", env={"TMPDIR": str(tmp)})
        while not server.hits["/trickle"]:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code, err = _stopped_within(proc, 8)
        assert code == 143, err

        # The second signal exits at once; the lock, the temp folder and its partial
        # download go with it.
        proc = _start(job, out, "--allow-private-urls", env={"TMPDIR": str(tmp)})
        while server.hits["/trickle"] < 2:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        assert list(tmp.glob("batchgen-*/download-*.part"))
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        code, _ = _stopped_within(proc, 8)
    assert code == 143
    assert not out.with_name(out.name + ".lock").exists()
    assert not list(tmp.glob("batchgen-*"))


def test_the_second_signal_runs_the_cleanups_before_exiting(tmp_path, monkeypatch):
    from batchgen.cli.process import Signals

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    lock, folder = tmp_path / "out.parquet.lock", tmp_path / "batchgen-x"
    lock.write_text("1")
    (folder / "download-1.part").parent.mkdir()
    (folder / "download-1.part").write_bytes(b"x")
    signals = Signals()
    signals.stop.cleanups += [lambda: lock.unlink(missing_ok=True), lambda: shutil.rmtree(folder)]
    signals.handle(signal.SIGTERM, None)
    assert signals.stop.is_set() and lock.exists() and not exits  # the first only asks
    with pytest.raises(SystemExit):
        signals.handle(signal.SIGTERM, None)
    assert exits == [143] and not lock.exists() and not folder.exists()

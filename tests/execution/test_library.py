"""The library owns no process: `batchgen.run(config, progress=..., stop=...)` prints nothing,
installs no signal handler, reports progress through its callback and stops when asked."""

from __future__ import annotations

import json
import signal
import threading

import pytest
from conftest import MODELS, read, write_jsonl
from fakes import answer, scripted_generator

import batchgen
from batchgen.core.errors import Interrupted
from batchgen.core.records import Job
from batchgen.core.stop import Stop


def _config(job, out, **more):
    return batchgen.build_config(
        job, out, None, {"temperature": 0.0, "max_tokens": 3}, model=str(MODELS / "tiny-lm"),
        batch_size=2, window=2, **more,
    )  # fmt: skip


def test_run_reports_through_its_callback_and_prints_nothing(tmp_path, capfd):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(6)])
    out = tmp_path / "out.parquet"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    seen = []

    def progress(report):
        seen.append((report.rows, report.total, report.done_before, report.summary.generated))
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # none of its own

    summary = batchgen.run(_config(job, out), progress=progress)
    assert (summary.rows, summary.ok) == (6, 6)
    assert seen[0] == (0, 6, 0, 0)  # the start
    assert sum(rows for rows, *_ in seen) == 6 and seen[-1][3] == 6
    captured = capfd.readouterr()
    assert captured.out == "" and "resuming" not in captured.err and "rows/s" not in captured.err
    seen.clear()
    batchgen.run(_config(job, out), progress=progress)  # nothing to do: a start, no batch
    assert seen == [(0, 0, 6, 0)]


def test_a_set_stop_ends_the_run_between_batches_and_keeps_what_it_finished(tmp_path):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": f"r{i}", "prompt": f"Item {i}."} for i in range(8)])
    out = tmp_path / "out.parquet"
    stop = Stop()
    stop.cleanups.append(mine := lambda: None)  # the caller's own, before the run

    def progress(report):
        if report.rows:
            stop.set()  # as a signal handler would, after the first committed batch
            assert len(stop.cleanups) == 3  # the lock and the temp folder, for a caller's hard exit

    with pytest.raises(Interrupted, match="finished rows are kept in .*out.parquet.partial, rerun to resume"):
        batchgen.run(_config(job, out), progress=progress, stop=stop)
    assert stop.cleanups == [mine]  # the run's released with it, the caller's kept
    assert not (tmp_path / "out.parquet.lock").exists()
    summary = batchgen.run(_config(job, out), stop=threading.Event())  # a plain Event does too
    assert summary.ok == 8 and 0 < summary.generated < 8
    assert [r["id"] for r in read(out)] == [f"r{i}" for i in range(8)]


def test_a_generator_factory_given_by_argument_runs_every_row(tmp_path):
    """The seam tests plug into: no model is inspected; the Generator around the scripted
    router still joins a row's completions and judges its answer against its constraint."""
    rows = [{"id": "plain", "prompt": "Hi."}, {"id": "two", "prompt": "Hi.", "completions": 2},
            {"id": "choice", "prompt": "Yes or no?", "guided_choice": ["yes", "no"]}]  # fmt: skip
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    config = batchgen.build_config(job, tmp_path / "out.parquet", None, model="no-such-model")
    summary = batchgen.run(config, generator=scripted_generator)
    assert (summary.ok, summary.failed) == (2, 1)
    got = {r["id"]: r for r in read(tmp_path / "out.parquet")}
    assert (
        got["plain"]["generated_text"] == answer(Job(index=0, id="plain"))
        and got["plain"]["model"] == "scripted"
    )
    assert [c["text"] for c in json.loads(got["two"]["choices"])] == [answer(Job(index=1, id="two"))] * 2
    assert got["two"]["completion_tokens"] == 2 * len(answer(Job(index=1, id="two")).split())
    assert got["choice"]["status"] == "error" and got["choice"]["error_stage"] == "generate"
    error = got["choice"]["error"]
    assert error.startswith("the output is not one of its choices: it does not satisfy its choice"), error
    assert got["choice"]["generated_text"] == answer(
        Job(index=2, id="choice")
    )  # the answer kept, to show why

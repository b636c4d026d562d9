"""Cron-grade runs in real subprocesses: SIGKILL at any point loses nothing finished, a lock
keeps two runs off one output, SIGTERM stops cleanly and resumably."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from conftest import MODELS, read, write_jsonl

pytestmark = pytest.mark.slow  # subprocesses killed at random points

ROWS = 12


# `batchgen` with a pause after each finished row, so that a kill lands where the test wants.
_SLOW_BATCHGEN = """
import sys, time
import batchgen.execution.runner as runner
record, delay = runner.record_row, float(sys.argv.pop(1))
def slow(*args):
    record(*args)
    time.sleep(delay)
runner.record_row = slow
from batchgen.cli.commands import main
main(prog_name="batchgen")
"""


def _start(job, out, delay: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-c", _SLOW_BATCHGEN, str(delay), "run", str(job), "-o", str(out), "-q",
           "--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"),
           "--temperature", "0", "--max-tokens", "6", "--batch-size", "1"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for the process and collect its stderr (which also closes the pipe)."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _parts(out) -> int:
    return len(list(out.with_name(out.name + ".partial").glob("part-*.parquet")))


def _wait_for_parts(out, n: int, proc, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while _parts(out) < n:
        assert proc.poll() is None, _end(proc)
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)


@pytest.fixture
def job(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Row number {i}."} for i in range(ROWS)]
    return write_jsonl(tmp_path / "jobs.jsonl", rows)


@pytest.fixture
def reference(tmp_path, job):
    out = tmp_path / "reference.parquet"
    code, err = _end(_start(job, out))
    assert code == 0, err
    return read(out)


def _texts(rows):
    return [(r["id"], r["generated_text"]) for r in rows]


@pytest.mark.parametrize("after", [0, 3, 10])
def test_sigkill_at_any_point_then_rerun_gives_every_row_once(tmp_path, job, reference, after):
    out = tmp_path / "out.parquet"
    proc = _start(job, out, delay=0.3)
    if after:
        _wait_for_parts(out, after, proc)
    else:
        time.sleep(0.5)  # still starting: nothing written yet
    proc.send_signal(signal.SIGKILL)
    _end(proc, 30)
    assert not out.exists()
    assert _parts(out) >= after
    code, err = _end(_start(job, out))
    assert code == 0, err
    rows = read(out)
    assert _texts(rows) == _texts(reference)  # every id exactly once, in order, same text
    assert not out.with_name(out.name + ".partial").exists()


def test_a_second_run_on_the_same_output_exits_2_until_the_holder_dies(tmp_path, job):
    out = tmp_path / "out.parquet"
    holder = _start(job, out, delay=0.5)
    _wait_for_parts(out, 1, holder)
    code, err = _end(_start(job, out), 60)
    assert code == 2 and f"another batchgen run (pid {holder.pid})" in err
    holder.send_signal(signal.SIGKILL)
    _end(holder, 30)
    code, err = _end(_start(job, out))  # the dead holder's lock does not block
    assert code == 0, err
    assert [r["id"] for r in read(out)] == [f"r{i}" for i in range(ROWS)]
    assert not out.with_name(out.name + ".lock").exists()


def test_sigterm_stops_cleanly_with_143_and_the_rerun_resumes(tmp_path, job, reference):
    out = tmp_path / "out.parquet"
    proc = _start(job, out, delay=0.3)
    _wait_for_parts(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = _end(proc, 60)
    assert code == 143 and "stopped by SIGTERM" in err
    assert not out.exists() and _parts(out) >= 2
    assert not out.with_name(out.name + ".lock").exists()
    code, err = _end(_start(job, out))
    assert code == 0, err
    assert _texts(read(out)) == _texts(reference)

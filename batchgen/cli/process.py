"""What the command line owns while a run goes: signals, the log, the progress a person sees.

SIGINT/SIGTERM, the log, and a start line, a progress bar on a terminal or a progress line every
so often in a cron log, each with its time.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import click
from tqdm import tqdm

from ..core.settings import RunConfig
from ..core.stop import Stop
from ..execution.summary import TRACE, Progress

__all__ = ["Signals", "ProgressDisplay", "configure_logging", "say"]

log = logging.getLogger("batchgen.progress")


def configure_logging(level: str) -> None:
    """batchgen's lines at `level` (INFO: the start, resume and progress lines; DEBUG: a line
    per window and lane; TRACE: per row), other libraries' from WARNING; without a terminal
    (cron, a log file) every line starts with its date and time."""
    stamped = not sys.stderr.isatty()
    fmt = "%(asctime)s %(levelname)s %(message)s" if stamped else "%(message)s"
    logging.basicConfig(level=logging.WARNING, format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)
    logging.getLogger("batchgen").setLevel(TRACE if level == "TRACE" else level)


def say(message: str, level: str = "INFO") -> None:
    """A line for whoever reads stderr: as it is on a terminal; without one (cron, a log file)
    each line with its date, time and level, as the log's own lines have them."""
    if not sys.stderr.isatty():
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        message = "\n".join(f"{when} {level} {line}" for line in message.splitlines() or [""])
    click.echo(message, err=True)


class Signals:
    """The first SIGINT/SIGTERM sets `stop` (downloads give up, generation ends between decode
    steps, finished rows are written); the second runs the run's cleanups (the lock, the temp
    folder) and exits at once."""

    CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __init__(self) -> None:
        self.received: int | None = None
        self.stop = Stop()
        self._previous: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        """The handler of both signals while a run goes."""
        if self.received is not None:
            self.stop.clean_up()
            os._exit(self.CODES.get(signum, 1))
        self.received = signum
        self.stop.set()

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.CODES:
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        return self.CODES.get(signal.Signals(self.received), 130) if self.received is not None else 130

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop request"


class ProgressDisplay:
    """The run's progress callback: what resumes and the URL policy at the start, then a bar
    on a terminal, or without one (cron, a log file) a line every `every` seconds."""

    def __init__(self, config: RunConfig, quiet: bool, every: float):
        self.config, self.quiet, self.every = config, quiet, every
        if quiet:  # -q: errors, warnings and the closing line only
            logging.getLogger("batchgen").setLevel(max(logging.getLogger("batchgen").level, logging.WARNING))
        self.bar: tqdm | None = None
        self.last: Progress | None = None
        self._started = time.perf_counter()
        self._beat = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, report: Progress) -> None:
        self.last = report
        if self.quiet:
            return
        if self.bar is None:
            self._start(report)
            return
        if not report.rows:  # a staged job's next stage starts: the bar counts its rows
            self.bar.reset(total=report.total)
            self._started = time.perf_counter() - report.elapsed
            return
        self.bar.update(report.rows)
        self.bar.set_postfix_str(report.tail, refresh=False)

    def _start(self, report: Progress) -> None:
        c = self.config
        text = f" (text rows: {c.text_model})" if c.text_model and c.text_model != c.model else ""
        models = f"model {c.model}{text}"
        if c.models:  # rows name theirs; those that name none run on --model's
            models = f"models {', '.join(name for name, _ in c.models)} (rows naming none: {c.model_name})"
        engine = f"ray, {c.workers} workers" if c.executor == "ray" else "local"
        log.info(
            "start: %s → %s · %s rows, %s to do · %s · engine %s",
            c.input,
            c.output,
            f"{report.summary.job_rows:,}",
            f"{report.total:,}",
            models,
            engine,
        )
        if report.done_before and report.total:
            again = f", {report.retried:,} failed rows tried again" if report.retried else ""
            again += f", {report.redone:,} changed rows generated again" if report.redone else ""
            whole = report.done_before + report.total
            log.info("resuming: %s of %s rows done%s", f"{report.done_before:,}", f"{whole:,}", again)
        if report.summary.private_urls_allowed:
            log.warning("warning: private and loopback URLs are allowed for this run's media")
        self._started = time.perf_counter() - report.elapsed
        self.bar = tqdm(total=report.total, unit="row", file=sys.stderr, disable=None, dynamic_ncols=True)
        if not sys.stderr.isatty() and self.every > 0:
            self._thread = threading.Thread(target=self._heartbeat, name="batchgen-progress", daemon=True)
            self._thread.start()

    def _heartbeat(self) -> None:
        while not self._beat.wait(self.every):
            log.info(self.line())

    def line(self) -> str:
        report = self.last
        assert report is not None
        s, elapsed = report.summary, max(time.perf_counter() - self._started, 1e-9)
        rate = s.generated / elapsed
        left = (report.total - s.generated) / rate if rate else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left < 100 * 3600 else "unknown"
        return (
            f"progress: {s.generated:,}/{report.total:,} rows ({s.generated / max(report.total, 1):.1%}), "
            f"{rate:.2f} rows/s, {report.tail}, ETA {eta}"
        )

    def close(self) -> None:
        self._beat.set()
        if self.bar is not None:
            self.bar.close()

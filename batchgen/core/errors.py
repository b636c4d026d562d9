"""Errors: run-stopping ones with their exit code, row failures with their stage, message helpers."""

from __future__ import annotations

import re
from typing import Literal

__all__ = [
    "one_line",
    "plural",
    "describe",
    "short",
    "StopRequested",
    "BatchgenError",
    "ConfigError",
    "JobFileError",
    "FailFastError",
    "Interrupted",
    "OutputLockedError",
    "RunFailedError",
    "RowError",
    "Stage",
]

# The stages a row can fail in, in pipeline order (records.STAGES lists them).
Stage = Literal["read", "fetch", "decode", "frames", "generate"]

# Terminal controls (C0, DEL, C1), line separators and bidirectional overrides: a value holding
# them could move the cursor, recolour, forge a log line or reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def one_line(text: str) -> str:
    """Control characters (a newline in a path, an escape sequence) escaped: an error is one
    line, whatever it quotes, and nothing it quotes reaches the terminal as a control."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def plural(n: int, noun: str) -> str:
    """`1 row`, `2,000 rows`."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def describe(source: str | bytes, width: int = 80) -> str:
    """A reference short enough for a one-line error: data URLs lose their payload, control
    characters (a newline in a path) are escaped, bytes are named by their size."""
    if isinstance(source, bytes):
        return f"{len(source):,} bytes from the row"
    if source.startswith("data:"):
        source = f"{source.split(',', 1)[0][:width]},… ({len(source)} chars)"
    elif len(source) > width:
        source = source[: width - 1] + "…"
    return one_line(source)


def gist(message: str, stage: str | None = None) -> str:
    """An error without the parts that differ from row to row: a media stage's reference
    before ': ' (`https://x/a.png: HTTP 404` → `HTTP 404`); a `read` error keeps its field
    (`stop: True is not supported`)."""
    return (message if stage == "read" else message.split(": ", 1)[-1])[:120]


def short(e: BaseException, width: int = 200) -> str:
    """An exception's message on one line, cut to `width` characters."""
    return " ".join(str(e).split())[:width]


class BatchgenError(Exception):
    """Stops a run, before any work starts unless it says otherwise. `exit_code` follows Click:
    2 for usage errors."""

    exit_code = 2


class ConfigError(BatchgenError):
    """A bad flag, preset or model path."""


class JobFileError(BatchgenError):
    """A job file that cannot be read at all, or whose ids collide."""


class OutputLockedError(BatchgenError):
    """Another run holds the output."""


class RunFailedError(BatchgenError):
    """The run stopped after work had started: a model that could not load for a later row, a
    job file changed under it, a Ray run that failed. Finished rows are kept; a rerun resumes.
    Not 2, which says nothing was done."""

    exit_code = 6


class Interrupted(BatchgenError):
    """The caller asked the run to stop: finished rows are on disk. The CLI exits 130 or 143
    after SIGINT or SIGTERM."""

    exit_code = 130


class FailFastError(BatchgenError):
    """--fail-fast met a failed row; finished rows are kept for the next run to resume."""

    exit_code = 1


class RowError(Exception):
    """One row failed; it becomes an error row and the run goes on. `transient`: the failure
    may not happen again (a server down, a timeout, an engine error), so a rerun retries it."""

    def __init__(self, stage: Stage, message: str, transient: bool = False):
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.transient = transient


class StopRequested(BaseException):
    """A stop request (SIGINT/SIGTERM) seen between decode steps. A BaseException, so that no
    row-level `except Exception` turns it into a row error: it ends the batch, not a row."""

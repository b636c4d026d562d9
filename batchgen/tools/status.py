"""`batchgen status OUT`: where a run stands, from what runs leave beside their output.

It reads the lock (held while a run goes), the heartbeat (who, how far, how it ended) and the
last finished run's figures (`stats.json`); for a folder of shards, each shard's rows too.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.budget import human_duration
from ..core.errors import ConfigError, one_line, plural
from ..core.figures import RowGroup
from ..core.uris import is_uri
from ..output.run_files import (
    Heartbeat,
    OutputLock,
    heartbeat_path,
    lock_held,
    read_heartbeat,
    read_lock,
    stage_files,
)
from ..output.stats import read_figures, stats_path
from ..output.store import Store, strict_json

__all__ = ["OutputStatus", "ShardRows", "status_of", "EXIT_CODES", "exit_code", "render", "as_json"]

# `status`'s exit codes, apart from `run`'s: what a script polling a job needs to branch on.
EXIT_CODES = {"complete": 0, "failed-rows": 1, "incomplete": 4, "running": 5}  # 2: nothing to read
_ENDED = {
    "complete": "complete",
    "incomplete": "incomplete (--limit, or rows added since)",
    "time-limit": "at its --time-limit",
    "interrupted": "stopped (SIGINT or SIGTERM)",
    "failed": "with an error",
    "crashed": "with an internal error",
    "running": "without a word (killed, or the machine went down) after its last commit",
}
_CONCLUDED = ("complete", "incomplete", "time-limit")  # endings that wrote the stats


@dataclass(slots=True)
class ShardRows:
    name: str
    rows: int
    ok: int
    failed: int


@dataclass(slots=True)
class OutputStatus:
    """One output's state: `running`, `complete` (every row there; `failed` of them may have
    failed) or `incomplete` (rows left to do, no run on it)."""

    output: str
    state: str
    rows: int = 0
    ok: int = 0
    failed: int = 0
    pending: int = 0
    job_rows: int = 0
    errors_by_stage: dict[str, int] = field(default_factory=dict)
    last_run: Heartbeat | None = None  # the latest run's heartbeat (the running one's, while it runs)
    shards: list[ShardRows] = field(default_factory=list)
    groups: dict[str, list[RowGroup]] = field(default_factory=dict)  # several models: each one's rows
    stages: dict[str, OutputStatus] = field(default_factory=dict)  # a staged job: each stage's own run
    notes: list[str] = field(default_factory=list)  # files left out, and why

    @property
    def exit_code(self) -> int:
        if self.state == "complete" and self.failed:
            return EXIT_CODES["failed-rows"]
        return EXIT_CODES[self.state]


def status_of(output: str) -> OutputStatus:
    """The state of the run(s) writing `output`: a Parquet file or a folder of shards. Every
    file is read bounded, as a regular file only, and typed: a damaged or forged one is left
    out and named in `notes`, never trusted."""
    output = output.rstrip("/") or output
    store = Store(output)
    sharded = store.is_dir(output)
    beat_file, stats_file = heartbeat_path(output, sharded), str(stats_path(output, sharded))
    beat = read_heartbeat(store, beat_file)
    figures = read_figures(stats_file)
    status = OutputStatus(output, "incomplete", last_run=beat)
    for path, read in ((beat_file, beat), (stats_file, figures)):
        if read is None and _there(store, path):
            status.notes.append(
                f"{path}: not a file batchgen wrote (damaged, forged, not a regular file): left out"
            )
    status.stages = _stages(output)
    if beat is None and figures is None and not status.stages:
        raise ConfigError(f"{one_line(output)}: no batchgen run has written here (no heartbeat, no stats)")
    if figures is not None:
        status.rows, status.ok, status.failed = figures.rows, figures.ok, figures.failed
        status.pending, status.job_rows = figures.pending, figures.job_rows
        status.errors_by_stage, status.groups = figures.errors_by_stage, figures.groups
        status.state = "complete" if figures.complete else "incomplete"
    if beat is not None and (figures is None or beat.state not in _CONCLUDED):
        # The latest run ended before writing its figures: its committed rows wait in the parts.
        status.rows = max(status.rows, beat.done_before + beat.done)
        status.failed = min(status.rows, status.failed + beat.failed)
        status.ok = status.rows - status.failed
        status.pending = max(beat.todo - beat.done, 0)
        status.job_rows = max(status.job_rows, beat.done_before + beat.todo)
        status.state = "complete" if beat.state == "complete" else "incomplete"
    if figures is None and beat is None:  # a staged job before its first end: nothing of it written yet
        first = next(iter(status.stages.values()))
        status.job_rows = status.pending = max(first.job_rows, first.rows + first.pending)
    if _running(output, beat) or any(stage.state == "running" for stage in status.stages.values()):
        status.state = "running"
    if sharded and not is_uri(output):
        status.shards = _shards(Path(output))
    return status


def _stages(output: str) -> dict[str, OutputStatus]:
    """A staged job's stages that have committed rows, each one's status by name in order."""
    if is_uri(output):
        return {}
    found = {}
    for name, path in stage_files(Path(output)).items():
        try:
            found[name] = status_of(str(path))
        except ConfigError:  # started, nothing committed yet
            continue
    return found


def _there(store: Store, path: str) -> bool:
    try:
        return store.exists(path) if store.remote else os.path.lexists(path)
    except OSError:
        return False


_COUNTS = ("rows", "ok", "failed", "pending", "job_rows")


def _running(output: str, beat: Heartbeat | None) -> bool:
    """A run holds the output's lock. Asked of the kernel where it says (a pid reused since,
    or a lock file left by a killed run, is no holder), else of the pid the lock names; never
    by taking the lock, so a run starting meanwhile is never refused."""
    path = OutputLock(output).path
    pid = read_lock(path)
    if beat is not None and beat.host != socket.gethostname():
        return pid is not None and beat.state == "running"  # another machine's lock cannot be asked about
    held = lock_held(path)
    if held is not None:
        return held
    if pid is None or beat is not None and beat.pid == pid and beat.state != "running":
        return False  # no lock, or its run ended (its heartbeat says how): the lock is left over
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _shards(folder: Path) -> list[ShardRows]:
    out = []
    for path in sorted(folder.rglob("*.parquet")):
        name = path.relative_to(folder).as_posix()
        if any(part.startswith(("_", ".")) for part in Path(name).parts):
            continue  # parts in waiting, our own files
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                continue  # a FIFO would hang the read, a link may lead anywhere
            status = pq.read_table(path, columns=["status"]).column("status")
        except (OSError, ValueError, KeyError, pa.ArrowException):
            continue
        ok = pc.sum(pc.equal(status, "ok")).as_py() or 0
        out.append(ShardRows(name, len(status), ok, len(status) - ok))
    return out


def exit_code(statuses: list[OutputStatus]) -> int:
    """Several outputs' code: the first of running, incomplete, failed rows, complete."""
    codes = [s.exit_code for s in statuses]
    for code in (EXIT_CODES["running"], EXIT_CODES["incomplete"], EXIT_CODES["failed-rows"]):
        if code in codes:
            return code
    return 0


def _when(stamp: str | None) -> str:
    return stamp.replace("T", " ")[:19] if stamp else "?"


def render(s: OutputStatus, name: str | None = None) -> str:
    """The status as a person reads it: one headline (naming the output, or `name`), then what
    the latest run did; a staged job's stages so, each under its name."""
    stages = ", ".join(f"{stage} {n:,}" for stage, n in sorted(s.errors_by_stage.items()))
    failed = f"{s.failed:,} failed" + (f" ({stages})" if stages else "")
    counts = f"{plural(s.rows, 'row')}: {s.ok:,} ok, {failed}" if s.state != "running" else ""
    if s.state == "incomplete":
        counts = f"{s.rows:,} of {s.job_rows:,} rows, {s.pending:,} pending; {s.ok:,} ok, {failed}"
    lines = [f"{name or s.output}: {s.state}" + (f" · {counts}" if counts else "")]
    b = s.last_run
    if b is not None and s.state == "running":
        share = f" ({b.done / b.todo:.1%})" if b.todo else ""
        eta = f" · ETA {_when(b.eta)[11:]} (in {human_duration(b.eta_s)})" if b.eta and b.eta_s else ""
        lines.append(f"  pid {b.pid} on {b.host}, started {_when(b.started)}")
        lines.append(
            f"  {b.done:,} of {b.todo:,} rows to do committed{share}, {b.failed:,} failed, "
            f"{b.done_before:,} done before · {b.rows_per_s:.2f} rows/s{eta}"
        )
        lines.append(f"  last committed batch: {_when(b.last_commit) if b.last_commit else 'none yet'}")
    elif b is not None:
        how = _ENDED.get(b.state, b.state)
        ended = _when(b.ended or b.last_commit)
        lines.append(
            f"  last run: started {_when(b.started)}, ended {how} at {ended} (pid {b.pid} on {b.host})"
        )
        if b.message:
            lines.append(f"  {b.message}")
        if s.state == "incomplete":
            lines.append("  rerun the same command to resume")
    for column, groups in s.groups.items():
        for g in groups:
            ended = f"{g.ok:,} ok, {g.failed:,} failed"
            lines.append(f"  {column} {g.value or 'none'}: {plural(g.rows, 'row')}, {ended}")
    for shard in s.shards:
        lines.append(
            f"  shard {shard.name}: {plural(shard.rows, 'row')}, {shard.ok:,} ok, {shard.failed:,} failed"
        )
    for number, (stage, status) in enumerate(s.stages.items(), 1):
        lines += [f"  {line}" for line in render(status, f"stage {number} {stage}").splitlines()]
    lines += [f"  note: {note}" for note in s.notes]
    return "\n".join(
        map(one_line, lines)
    )  # names and messages come from files: no control reaches a terminal


def as_json(statuses: list[OutputStatus]) -> str:
    """One output's status as an object; several, as their list and their total."""
    items = [{**asdict(s), "exit_code": s.exit_code} for s in statuses]
    if len(items) == 1:
        return strict_json(items[0], indent=2)
    total: dict[str, int] = {k: sum(getattr(s, k) for s in statuses) for k in _COUNTS}
    total["exit_code"] = exit_code(statuses)
    return strict_json({"outputs": items, "total": total}, indent=2)

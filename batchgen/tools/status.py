"""`batchgen status OUT`: where a run stands, read from what runs leave beside their output —
the lock (one holds it while it runs), the heartbeat (who, how far, how it ended) and the last
finished run's figures (`stats.json`); for a folder of shards, each shard's rows too."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..core.budget import human_duration
from ..core.errors import ConfigError, plural
from ..core.uris import is_uri
from ..output.run_files import Heartbeat, OutputLock, heartbeat_path, read_heartbeat
from ..output.store import Store
from ..output.write import stats_path

__all__ = ["OutputStatus", "ShardRows", "status_of", "EXIT_CODES", "exit_code", "render", "as_json"]

# `status`'s exit codes, apart from `run`'s: what a script polling a job needs to branch on.
EXIT_CODES = {"complete": 0, "failed-rows": 1, "incomplete": 4, "running": 5}  # 2: nothing to read
_ENDED = {
    "complete": "complete", "incomplete": "incomplete (--limit, or rows added since)",
    "time-limit": "at its --time-limit", "interrupted": "stopped (SIGINT or SIGTERM)",
    "failed": "with an error", "crashed": "with an internal error",
    "running": "without a word (killed, or the machine went down) after its last commit",
}  # fmt: skip
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

    @property
    def exit_code(self) -> int:
        if self.state == "complete" and self.failed:
            return EXIT_CODES["failed-rows"]
        return EXIT_CODES[self.state]


def status_of(output: str) -> OutputStatus:
    """The state of the run(s) writing `output`: a Parquet file or a folder of shards."""
    output = output.rstrip("/") or output
    store = Store(output)
    sharded = store.is_dir(output)
    beat = read_heartbeat(store, heartbeat_path(output, sharded))
    figures = _figures(store, str(stats_path(output, sharded)))
    if beat is None and figures is None:
        raise ConfigError(f"{output}: no batchgen run has written here (no heartbeat, no stats)")
    status = OutputStatus(output, "incomplete", last_run=beat)
    if figures is not None:
        for name in ("rows", "ok", "failed", "pending", "job_rows"):
            setattr(status, name, int(figures.get(name) or 0))
        status.errors_by_stage = dict(figures.get("errors_by_stage") or {})
        status.state = "complete" if figures.get("complete") else "incomplete"
    if beat is not None and (figures is None or beat.state not in _CONCLUDED):
        # The latest run ended before writing its figures: its committed rows wait in the parts.
        status.rows = max(status.rows, beat.done_before + beat.done)
        status.pending = max(beat.todo - beat.done, 0)
        status.job_rows = max(status.job_rows, beat.done_before + beat.todo)
        status.state = "complete" if beat.state == "complete" else "incomplete"
    if _running(output, beat):
        status.state = "running"
    if sharded and not is_uri(output):
        status.shards = _shards(Path(output))
    return status


def _figures(store: Store, path: str) -> dict | None:
    try:
        value = json.loads(store.read_text(path))
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _running(output: str, beat: Heartbeat | None) -> bool:
    """A run holds the output: its lock file is there and the pid written in it is alive
    (asked without touching the lock, so a run starting meanwhile is never refused)."""
    lock = OutputLock(output).path
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if beat is not None and beat.host != socket.gethostname():
        return beat.state == "running"  # another machine's pid cannot be asked about
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return pid > 0


def _shards(folder: Path) -> list[ShardRows]:
    out = []
    for path in sorted(folder.rglob("*.parquet")):
        name = path.relative_to(folder).as_posix()
        if any(part.startswith(("_", ".")) for part in Path(name).parts):
            continue  # parts in waiting, our own files
        try:
            status = pq.read_table(path, columns=["status"]).column("status")
        except (OSError, ValueError, KeyError):
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


def render(s: OutputStatus) -> str:
    """The status as a person reads it: one headline, then what the latest run did."""
    stages = ", ".join(f"{stage} {n:,}" for stage, n in sorted(s.errors_by_stage.items()))
    failed = f"{s.failed:,} failed" + (f" ({stages})" if stages else "")
    counts = f"{plural(s.rows, 'row')}: {s.ok:,} ok, {failed}" if s.state != "running" else ""
    if s.state == "incomplete":
        counts = f"{s.rows:,} of {s.job_rows:,} rows, {s.pending:,} pending; {s.ok:,} ok, {failed}"
    lines = [f"{s.output}: {s.state}" + (f" · {counts}" if counts else "")]
    b = s.last_run
    if b is not None and s.state == "running":
        share = f" ({b.done / b.todo:.1%})" if b.todo else ""
        eta = f" · ETA {_when(b.eta)[11:]} (in {human_duration(b.eta_s)})" if b.eta and b.eta_s else ""
        lines.append(f"  pid {b.pid} on {b.host}, started {_when(b.started)}")
        lines.append(f"  {b.done:,} of {b.todo:,} rows to do committed{share}, {b.failed:,} failed, "
                     f"{b.done_before:,} done before · {b.rows_per_s:.2f} rows/s{eta}")  # fmt: skip
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
    for shard in s.shards:
        lines.append(
            f"  shard {shard.name}: {plural(shard.rows, 'row')}, {shard.ok:,} ok, {shard.failed:,} failed"
        )
    return "\n".join(lines)


def as_json(statuses: list[OutputStatus]) -> str:
    """One output's status as an object; several, as their list and their total."""
    items = [{**asdict(s), "exit_code": s.exit_code} for s in statuses]
    if len(items) == 1:
        return json.dumps(items[0], indent=2)
    total = {k: sum(getattr(s, k) for s in statuses) for k in ("rows", "ok", "failed", "pending", "job_rows")}
    return json.dumps({"outputs": items, "total": {**total, "exit_code": exit_code(statuses)}}, indent=2)

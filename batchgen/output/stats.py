"""The stats file beside an output: where it is, how a run writes it, the typed figures read back.

`OUT.stats.json`, a shard folder's `_stats.json`. Its readers (`status`, `inspect`, the error
file's owner check) take back typed figures, each checked for its type: a file that is damaged,
forged or not a regular file is nobody's. A run with nothing to do (a cron rerun) keeps the last
real run's figures and notes itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.figures import GROUPED_BY, MAX_GROUPS, RowGroup
from ..core.uris import is_uri
from .store import Store, is_count, is_measure, json_object, strict_json

__all__ = ["STATS_BYTES", "Figures", "stats_path", "read_figures", "write_stats"]

STATS_BYTES = 1 << 20  # a run's figures are a few KB: a larger stats file is not one
# What a run with nothing to do writes over the last real run's figures: where the output stands.
_STANDING = (
    "rows",
    "ok",
    "failed",
    "failed_now",
    "failed_earlier",
    "job_rows",
    "pending",
    "complete",
    "time_limited",
    "errors_file",
    "errors_sha256",
)


def stats_path(output: Path | str, sharded: bool = False) -> Path | str:
    name = f"{output}/_stats.json" if sharded else f"{output}.stats.json"
    return name if is_uri(str(output)) else Path(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """What readers take from a stats file: where the output stands (rows, ok, failed by stage,
    pending, each model's and adapter's rows), the last run's speed, the error file it wrote."""

    rows: int
    ok: int
    failed: int
    pending: int
    job_rows: int
    complete: bool
    errors_by_stage: dict[str, int] = field(default_factory=dict)
    groups: dict[str, list[RowGroup]] = field(default_factory=dict)
    wall_s: float | None = None  # the last run's, when it generated rows
    rows_per_s: float | None = None
    tokens_per_s: float | None = None
    errors_sha256: str | None = None


def read_figures(path: Path | str) -> Figures | None:
    """The figures in the stats file at `path`, or None: none there, or not a file batchgen
    wrote (a count that is not one, a stage's name that is not text, too large, a FIFO)."""
    data = json_object(Store(str(path)).read_small(str(path), STATS_BYTES))
    if not data or "rows" not in data:  # every stats file batchgen writes counts its rows
        return None
    rows, ok, failed, pending, job_rows = (
        data.get(k) or 0 for k in ("rows", "ok", "failed", "pending", "job_rows")
    )
    stages = data.get("errors_by_stage") or {}
    if not all(map(is_count, (rows, ok, failed, pending, job_rows))) or not isinstance(stages, dict):
        return None
    if len(stages) > 64 or not all(
        isinstance(k, str) and len(k) <= 64 and is_count(v) for k, v in stages.items()
    ):
        return None
    groups = _groups(data.get("groups"))
    if groups is None:
        return None
    wall_s, rows_per_s, tokens_per_s = (
        _measure(data.get(k)) for k in ("wall_s", "rows_per_s", "tokens_per_s")
    )
    digest = data.get("errors_sha256")
    return Figures(
        rows=rows,
        ok=ok,
        failed=failed,
        pending=pending,
        job_rows=job_rows,
        complete=data.get("complete") is True,
        errors_by_stage=stages,
        groups=groups,
        wall_s=wall_s,
        rows_per_s=rows_per_s,
        tokens_per_s=tokens_per_s,
        errors_sha256=digest if isinstance(digest, str) and len(digest) == 64 else None,
    )


def _measure(value: object) -> float | None:
    return float(value) if is_measure(value) else None


def _groups(value: object) -> dict[str, list[RowGroup]] | None:
    """The stats' rows per model and adapter, each typed and bounded (None: not batchgen's)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not set(value) <= set(GROUPED_BY):
        return None
    out: dict[str, list[RowGroup]] = {}
    for column, items in value.items():
        if not isinstance(items, list) or len(items) > MAX_GROUPS:
            return None
        try:
            out[column] = [RowGroup(**item) for item in items]
        except TypeError:  # a missing or unknown key
            return None
        if not all(map(_typed, out[column])):
            return None
    return out


def _typed(group: RowGroup) -> bool:
    counts = is_count(group.rows) and is_count(group.ok) and group.ok <= group.rows
    return isinstance(group.value, str) and len(group.value) <= 4096 and counts


def write_stats(store: Store, path: str, figures: dict[str, Any]) -> None:
    """A run's figures (its summary, as a dict) to the stats file. A run that generated nothing
    over a stats file there keeps that run's figures, with where the output stands now and
    when this run found nothing to do (`last_noop`); an unreadable one is replaced."""
    if not figures.get("generated") and store.exists(path):
        previous = json_object(store.read_small(path, STATS_BYTES))
        if previous is not None:
            now = {k: figures[k] for k in _STANDING if k in figures}
            figures = {**previous, **now, "last_noop": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    store.write_text(path, strict_json(figures, indent=2) + "\n")

"""Resume: what a rerun may take from earlier runs, decided in one place before any work.

The settings fingerprint must not change; finished rows are kept unless their input changed
since; failed rows are tried again.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..core.errors import ConfigError, describe
from ..core.files import adapter_digest, file_digest, local_path
from ..core.params import SEEDED_SAMPLER, GenParams
from ..core.settings import Fingerprint, RunConfig
from ..input.read import JobIndex, id_key
from .parts import Earlier
from .pending import Pending
from .store import Store

__all__ = [
    "Resume",
    "settings_of",
    "check_settings",
    "read_earlier",
    "finished",
    "check_unchanged",
    "looped",
    "Pending",
    "replaced",
    "Replaced",
]


_MODELS = ("model", "text_model", "draft_model")


def _canonical(model: object) -> object:
    """A local checkout by its absolute path (the same from any folder), a hub id as it is."""
    if isinstance(model, str) and model and Path(model).expanduser().exists():
        return str(Path(model).expanduser().resolve())
    return model


def settings_of(config: RunConfig) -> Fingerprint:
    """What decides the content of the output: resuming under other settings is refused."""
    m = config.media
    kv = [config.kv_bits, config.kv_group_size, config.quantized_kv_start]
    return (
        {
            "model": _canonical(config.model),
            "text_model": _canonical(config.text_model),
            "draft_model": _canonical(config.draft_model),
            "draft": [config.num_draft_tokens, config.draft_kind, config.draft_block_size],
            "generation": json.loads(json.dumps(asdict(config.defaults), default=list)),
            "video": [m.video_fps, m.video_min_frames, m.video_max_frames],
            "shard": list(config.shard) if config.shard else None,
        }
        | ({"kv_cache": kv} if config.kv_bits else {})
        | ({"models": {n: _canonical(path) for n, path in config.models}} if config.models else {})
        | ({"adapter": _canonical(config.adapter)} if config.adapter else {})
        | ({"adapters": {n: _canonical(path) for n, path in config.adapters}} if config.adapters else {})
        | ({"adapters_fused": True} if config.fuse_adapters else {})
        | _sampler(config)
    )  # absent when off: earlier outputs resume; an adapter's content is its rows' (adapter_sha256)


def _sampler(config: RunConfig) -> Fingerprint:
    """A run whose default is seeded sampling records how its rows draw (rows with their own
    seed record it in their fingerprints)."""
    d = config.defaults
    return {"sampler": SEEDED_SAMPLER} if d.seed is not None and d.temperature > 0 else {}


def check_settings(where: str, previous: Fingerprint | None, settings: Fingerprint) -> None:
    """Refuse to mix results made under other settings, naming the keys that changed."""
    # Outputs of earlier versions stored model paths as given, relative to that run's folder,
    # and knew fewer generation parameters (the ones added since had their defaults).
    previous = previous and {k: _canonical(v) if k in _MODELS else v for k, v in previous.items()}
    if previous:  # the first outputs with adapters kept their content here too: {folder, sha256}
        previous = {k: _folders(v) if k in ("adapter", "adapters") else v for k, v in previous.items()}
    if previous and isinstance(previous.get("generation"), dict):
        defaults = json.loads(json.dumps(asdict(GenParams()), default=list))
        previous["generation"] = {**defaults, **previous["generation"]}
    if previous is None or previous == settings:
        return
    changes = ", ".join(f"{k}: {then!r} then, {now!r} now" for k, then, now in _changed(previous, settings))
    raise ConfigError(f"{where} were made with other settings ({changes}); pass --overwrite to start over")


def _folders(value: Any) -> Any:
    """An adapter setting as folders only."""
    if isinstance(value, dict) and "folder" in value:
        return value["folder"]
    return {k: _folders(v) for k, v in value.items()} if isinstance(value, dict) else value


def _changed(previous: Fingerprint, settings: Fingerprint, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(key, then, now) of each setting that differs; within a mapping (the generation
    parameters), only the entries that differ: `generation.max_tokens: 48 then, 5 now`."""
    out = []
    for k in sorted({*previous, *settings}):
        then, now = previous.get(k), settings.get(k)
        if then == now:
            continue
        if isinstance(then, dict) and isinstance(now, dict):
            out += _changed(then, now, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", then, now))
    return out


# The columns of earlier results every rerun reads: each row's input, its failure, its adapter.
_READ = ("id", "input_hash", "status", "transient", "attempts", "adapter", "adapter_sha256")


def read_earlier(sources: Iterable[Path | str], store: Store, columns: Iterable[str]) -> list[pa.Table]:
    """These columns of each earlier result file, each file read once (an earlier version's
    output, or a slim one, lacks some: they are left out)."""
    tables = []
    for path in sources:
        names = set(store.metadata_schema(str(path)).names)
        tables.append(store.read_table(str(path), [c for c in columns if c in names]))
    return tables


def finished(tables: Iterable[pa.Table]) -> dict[str, str | None]:
    """The input hash, by id key, of every row in these results (later tables win)."""
    hashes: dict[str, str | None] = {}
    for t in tables:
        for i, h in zip(t.column("id").to_pylist(), t.column("input_hash").to_pylist(), strict=True):
            hashes[id_key(i)] = h
    return hashes


def to_retry(tables: Iterable[pa.Table], max_attempts: int, every_failure: bool) -> dict[str, int]:
    """Failed rows a rerun tries again, by id key, with the attempts they have had: every failed
    row with `every_failure` (--retry-failed), else those whose failure was transient and that
    have had fewer than `max_attempts` runs. Outputs of earlier versions count one attempt."""
    latest: dict[str, tuple[str, bool, int]] = {}
    for table in tables:
        columns = [c for c in ("id", "status", "transient", "attempts") if c in table.column_names]
        t = table.select(columns).to_pydict()
        n = len(t["id"])
        for row_id, status, transient, attempts in zip(
            t["id"], t["status"], t.get("transient", [False] * n), t.get("attempts", [1] * n), strict=True
        ):
            latest[id_key(row_id)] = (status, bool(transient), attempts or 1)
    return {
        key: attempts
        for key, (status, transient, attempts) in latest.items()
        if status == "error" and (every_failure or (transient and attempts < max_attempts))
    }


def looped(tables: Iterable[pa.Table]) -> set[str]:
    """Rows whose latest record the loop stop ended (finish_reason repetition); a slim output
    keeps no finish reasons, so none."""
    latest: dict[str, Any] = {}
    for table in tables:
        if "finish_reason" not in table.column_names:
            continue
        t = table.select(["id", "finish_reason"]).to_pydict()
        latest.update(zip(map(id_key, t["id"]), t["finish_reason"], strict=True))
    return {key for key, reason in latest.items() if reason == "repetition"}


def replaced_media(tables: Iterable[pa.Table], base: str | None, keys: set[str]) -> dict[str, str]:
    """The rows among `keys` whose local media file was replaced since their result was
    written (id key → the file's reference): its size or mtime differ from what the run
    recorded, and, where the run recorded its content digest, its content too (a copy or a
    `touch` keeps the result). A file gone counts as replaced."""
    if base is None:  # a remote job reads no local file
        return {}
    latest: dict[str, list[dict[str, Any]]] = {}
    for table in tables:
        if "media_files" not in table.column_names:  # an earlier version's output
            continue
        t = table.select(["id", "media_files"]).to_pydict()
        for row_id, files in zip(t["id"], t["media_files"], strict=True):
            if files and (key := id_key(row_id)) in keys:
                latest[key] = files
    check = Replaced(lambda ref: local_path(ref, Path(base)))
    return {key: refs[0] for key, files in latest.items() if (refs := check.refs(files))}


def retrained(tables: Iterable[pa.Table], keys: set[str]) -> dict[str, str]:
    """The rows among `keys` whose adapter changed since their result was written (id key →
    the adapter, as an error names it): its files' content is not what the run recorded
    (`adapter_sha256`), or they are gone. Each adapter is read once."""
    latest: dict[str, tuple[str, str]] = {}
    for table in tables:
        if "adapter_sha256" not in table.column_names:  # an earlier version's output
            continue
        t = table.select(["id", "adapter", "adapter_sha256"]).to_pydict()
        for row_id, folder, digest in zip(t["id"], t["adapter"], t["adapter_sha256"], strict=True):
            if folder and digest and (key := id_key(row_id)) in keys:
                latest[key] = (folder, digest)
    now: dict[str, str | None] = {}
    for folder in {folder for folder, _ in latest.values()}:
        try:
            now[folder] = adapter_digest(folder)
        except OSError:
            now[folder] = None
    return {key: f"adapter {folder}" for key, (folder, digest) in latest.items() if now[folder] != digest}


class Replaced:
    """Which of a row's recorded media files (`media_files`) were replaced since the run read
    them, each distinct file checked once however many rows name it. `locate` gives a
    reference's local file (None: none the caller may open, which is not checked)."""

    def __init__(self, locate: Callable[[str], Path | None]):
        self.locate = locate
        self.seen: dict[tuple[object, ...], bool] = {}

    def refs(self, files: Iterable[dict[str, Any]]) -> list[str]:
        out = []
        for f in files:
            if f["ref"] is None or f["mtime_ns"] is None:  # bytes, a URL, or an earlier version's record
                continue
            mark = (f["ref"], f["size"], f["mtime_ns"], f["sha256"])
            if mark not in self.seen:
                path = self.locate(f["ref"])
                self.seen[mark] = path is not None and replaced(path, f)
            if self.seen[mark]:
                out.append(f["ref"])
        return out


def replaced(path: Path, recorded: dict[str, Any]) -> bool:
    """Whether the file at `path` is no longer the one a run read (`recorded`, a MediaFile's
    fields): another size or mtime, and then, where the run kept its digest, other content."""
    try:
        now = path.stat()
    except (OSError, ValueError):
        return True
    if (now.st_size, now.st_mtime_ns) == (recorded["size"], recorded["mtime_ns"]):
        return False
    if now.st_size != recorded["size"] or recorded["sha256"] is None or not stat.S_ISREG(now.st_mode):
        return True
    try:
        return file_digest(path) != recorded["sha256"]
    except OSError:
        return True


def check_unchanged(
    index: JobIndex,
    done: dict[str, str | None],
    policy: str = "refuse",
    replaced: dict[str, str] | None = None,
) -> list[int]:
    """Rows whose input changed under an id that already has a result — the row itself, or a
    local media file it read (`replaced`, by id key) — refused (ConfigError naming the first
    five), or returned, for the caller to redo or keep."""
    replaced = replaced or {}
    changed = [
        i
        for i, key in enumerate(map(id_key, index.ids))
        if done.get(key) not in (None, index.rows.digest(i)) or (key in done and key in replaced)
    ]
    if changed and policy == "refuse":
        wheres = index.wheres(changed[:5])
        named = [
            f"{where} (id {index.ids[i]!r:.80}"
            + (f"; {describe(replaced[k])} replaced" if (k := id_key(index.ids[i])) in replaced else "")
            + ")"
            for i, where in zip(changed[:5], wheres, strict=True)
        ]
        shown = ", ".join(named) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise ConfigError(
            f"{len(changed)} row(s) changed since their results were written: {shown}; pass --changed "
            "redo to generate them again, --changed keep to keep their results, or --overwrite to start over"
        )
    return changed


class Resume:
    """This run's view of earlier ones, decided before any work: their settings must be this
    run's (else ConfigError), their finished rows are kept unless their input changed since
    (ConfigError naming the rows), and their failed rows are tried again when the failure was
    transient and attempts are left (all of them with `every_failure`). Rows changed since
    their results were written are refused, generated again (`changed` redo: their new
    record replaces the old one) or kept as they are (`keep`)."""

    def __init__(
        self,
        earlier: Earlier,
        store: Store,
        index: JobIndex,
        settings: Fingerprint,
        *,
        max_attempts: int,
        every_failure: bool,
        changed: str = "refuse",
        redo_looped: bool = False,
    ):
        if earlier.settings is not None:
            check_settings(earlier.where, earlier.settings, settings)
        # The recorded media files only where local ones can be checked, finish reasons only
        # for --redo-repetition.
        more: tuple[str, ...] = ("media_files",) if index.base is not None else ()
        more += ("finish_reason",) if redo_looped else ()
        tables = read_earlier(earlier.files, store, (*_READ, *more))
        self.done = finished(tables)
        replaced = replaced_media(tables, index.base, set(self.done)) if self.done else {}
        replaced |= retrained(tables, set(self.done)) if self.done else {}
        rows = check_unchanged(index, self.done, changed, replaced)
        self.redone = len(rows) if changed == "redo" else 0  # changed rows generated again
        for i in rows if changed == "redo" else []:
            self.done.pop(id_key(index.ids[i]), None)
        retry = to_retry(tables, max_attempts, every_failure) if self.done else {}
        if retry:  # only this job's rows (its --shard, its --limit)
            keys = {id_key(i) for i in index.ids}
            retry = {k: n for k, n in retry.items() if k in keys}
        for key in retry:
            self.done.pop(key, None)
        self.retry = retry
        again = looped(tables) & set(self.done) if redo_looped and self.done else set()
        for key in again:  # --redo-repetition: the rows the loop stop ended
            self.done.pop(key, None)
        self.pending = Pending(index, self.done, frozenset(again))
        self.todo = sum(id_key(i) not in self.done for i in index.ids)
        self.done_before = len(index.ids) - self.todo

    def attempts(self, row_id: object) -> int:
        """The attempts a row has had once this run has generated it."""
        return self.retry.get(id_key(row_id), 0) + 1

"""An output's own Parquet metadata: what its readers need that its rows do not say."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.settings import Fingerprint
from .store import is_count

__all__ = ["About", "JobAbout", "MediaAbout", "Standing"]

# The metadata's keys, each holding one field of About (text, or JSON for a record).
_KEYS = {
    "settings": b"batchgen.settings",  # the settings that made the output: a rerun's check
    "media_base": b"batchgen.media_base",  # where the job's relative media paths start (report)
    "media": b"batchgen.media_policy",  # which local media the run could read: report reads no other
    "template": b"batchgen.prompt_template",  # the --prompt-template the prompts were made with
    "job": b"batchgen.job",  # the job (a local one's path), its id column and mapped media columns
    "standing": b"batchgen.complete",  # whether it holds every row of its job, how many are pending
}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobAbout:
    """The job as the run read it: a local job's path and format (the gallery and export read
    the pictures the output does not carry from there), its id column, the columns its
    questions and media came from, and the columns only the job holds."""

    path: str | None = None
    format: str | None = None
    id_column: str | None = None
    prompt: str | None = None
    system: str | None = None
    image: tuple[str, ...] = ()
    video: tuple[str, ...] = ()
    not_carried: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaAbout:
    """Which local media the run could read (a report shows no other)."""

    local_paths: bool = True
    media_root: str | None = None
    allow_private_urls: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Standing:
    """Whether the output holds every row of its job; a reader must not take a --limit's
    output for the whole job."""

    complete: bool
    job_rows: int
    pending: int


@dataclass(frozen=True, slots=True, kw_only=True)
class About:
    """What an output's metadata says. Read from any file, each value is checked for its type:
    a field that is missing (an earlier version's output) or not what batchgen writes is None."""

    settings: Fingerprint | None = None
    media_base: str | None = None
    media: MediaAbout | None = None
    template: str | None = None
    job: JobAbout | None = None
    standing: Standing | None = None

    def metadata(self) -> dict[bytes, bytes]:
        """The fields that are set, under their keys."""
        out = {}
        for name, key in _KEYS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                value = json.dumps(value if isinstance(value, dict) else _fields(value), sort_keys=True)
            out[key] = value.encode()
        return out

    @classmethod
    def of(cls, metadata: Mapping[bytes, bytes] | None) -> About:
        """The metadata of an output (a Parquet schema's), read back."""
        meta = metadata or {}

        def text(name: str) -> str | None:
            try:
                return meta[_KEYS[name]].decode() if _KEYS[name] in meta else None
            except UnicodeDecodeError:
                return None

        def record(name: str) -> dict[str, Any] | None:
            raw = text(name)
            try:
                value = json.loads(raw) if raw else None
            except (ValueError, RecursionError):
                return None
            return value if isinstance(value, dict) else None

        return cls(
            settings=record("settings"),
            media_base=text("media_base"),
            media=_media(record("media")),
            template=text("template"),
            job=_job(record("job")),
            standing=_standing(record("standing")),
        )


def _fields(record: JobAbout | MediaAbout | Standing) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


def _job(value: dict[str, Any] | None) -> JobAbout | None:
    if value is None:
        return None

    def named(key: str) -> str | None:
        return value[key] if isinstance(value.get(key), str) else None

    def listed(key: str) -> tuple[str, ...]:
        items = value.get(key)
        return tuple(c for c in items if isinstance(c, str)) if isinstance(items, list) else ()

    return JobAbout(
        path=named("path"),
        format=named("format"),
        id_column=named("id_column"),
        prompt=named("prompt"),
        system=named("system"),
        image=listed("image"),
        video=listed("video"),
        not_carried=listed("not_carried"),
    )


def _media(value: dict[str, Any] | None) -> MediaAbout | None:
    if value is None:
        return None
    root = value.get("media_root")
    return MediaAbout(
        local_paths=value.get("local_paths") is not False,
        media_root=root if isinstance(root, str) else None,
        allow_private_urls=value.get("allow_private_urls") is True,
    )


def _standing(value: dict[str, Any] | None) -> Standing | None:
    if value is None:
        return None
    complete, job_rows, pending = value.get("complete"), value.get("job_rows"), value.get("pending")
    if not isinstance(complete, bool) or not is_count(job_rows) or not is_count(pending):
        return None
    return Standing(complete=complete, job_rows=job_rows, pending=pending)

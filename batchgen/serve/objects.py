"""The API's objects as the OpenAI clients read them, and the records the store keeps."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["FileObject", "Batch", "FileRecord", "BatchRecord", "BatchCreate", "page"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"  # deprecated, still required
    expires_at: int | None = None
    status_details: str | None = None


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: dict[str, int] = Field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    metadata: dict[str, str] | None = None
    model: str | None = None


class FileRecord(FileObject):
    """A stored file: its FileObject, and its request lines (for the status page)."""

    lines: int = 0

    def api(self) -> dict[str, Any]:
        return self.model_dump(exclude={"lines"})


class BatchRecord(Batch):
    """A stored batch: its Batch object, and the run's pace (for the status page)."""

    eta_s: float | None = None  # seconds left at the run's pace

    def api(self) -> dict[str, Any]:
        return self.model_dump(exclude={"eta_s"})


class BatchCreate(BaseModel):
    """POST /v1/batches: unknown fields refused, metadata as the API bounds it (16 pairs, keys
    up to 64 characters, values up to 512)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # the client may send it; files here do not expire

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("metadata holds at most 16 pairs, keys of 64 characters, values of 512")
        return value


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list as the API pages it: newest first, `after` the last id of the page before."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }

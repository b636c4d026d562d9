"""The HTTP side of `batchgen serve`: the OpenAI Files and Batches endpoints and the status page.

The key is checked in the ASGI layer (`Guard`), before any body is read: a request without it
is answered 401 at once. An upload is counted while it streams and refused past the size
limit (413) or the line limit (400), leaving nothing under the data folder. Errors are the
API's `{"error": {message, type, param, code}}`, parameter errors 400 (not a framework's 422,
which a Batch client does not expect).
"""

from __future__ import annotations

import base64
import hmac
import shutil
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.types import ASGIApp, Receive, Scope, Send

from ..output.store import atomic_write
from ..tools.gallery import write_gallery
from .objects import BatchCreate, BatchRecord, FileRecord, page
from .page import status_page
from .queue import ENDPOINTS, Queue, ServeSettings, window_seconds
from .store import Store

__all__ = ["make_app", "Guard"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
}


class ApiError(HTTPException):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message)
        self.param, self.code = param, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


class Guard:
    """The API key, checked before the app sees the request: a bearer token (the clients'), or
    HTTP Basic with the key as password (a browser on the status page). `key` None: no check
    (only on loopback, `--no-auth`)."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = _error(401, "Incorrect API key provided.", code="invalid_api_key")
        response.headers["WWW-Authenticate"] = 'Basic realm="batchgen"'
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        assert self.key is not None
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                value = base64.b64decode(value, validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.encode(), self.key.encode())


def make_app(store: Store, queue: Queue, settings: ServeSettings) -> FastAPI:
    """The endpoints over `store`; `queue` is woken when a batch is created or cancelled."""
    app = FastAPI(title="batchgen", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), getattr(e, "param", None), getattr(e, "code", None))

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        return _error(500, f"the server failed on this request: {type(e).__name__}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", where or None)

    for router in (_files(store, settings), _batches(store, queue, settings), _pages(store, settings)):
        app.include_router(router)
    return app


def _file(store: Store, file_id: str) -> FileRecord:
    record = store.file(file_id)
    if record is None:
        raise ApiError(404, f"No such File object: {file_id[:80]}", "id")
    return record


def _batch(store: Store, batch_id: str) -> BatchRecord:
    record = store.batch(batch_id)
    if record is None:
        raise ApiError(404, f"No such batch: {batch_id[:80]}", "id")
    return record


def _files(store: Store, settings: ServeSettings) -> APIRouter:
    """/v1/files: upload, list, look at, read and delete."""
    router = APIRouter(prefix="/v1/files")

    @router.post("")
    async def upload(request: Request) -> dict[str, Any]:
        form = await _form(request, settings.max_file_bytes)
        upload = form.get("file")
        try:
            if form.get("purpose") != "batch":
                raise ApiError(400, "purpose must be 'batch' (the only files this server takes)", "purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a file part named 'file' is required", "file")
            record = await run_in_threadpool(_kept, upload, store, settings.max_lines)
        finally:
            await form.close()
        return record.api()

    @router.get("")
    def list_files(after: str | None = None, limit: int = 10000, purpose: str | None = None) -> dict:
        records, more = store.files(after, max(1, min(limit, 10000)), purpose)
        return page([r.api() for r in records], more)

    @router.get("/{file_id}")
    def get_file(file_id: str) -> dict[str, Any]:
        return _file(store, file_id).api()

    @router.get("/{file_id}/content")
    def content(file_id: str) -> FileResponse:
        return FileResponse(store.file_path(_file(store, file_id).id), media_type="application/jsonl")

    @router.delete("/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        record = _file(store, file_id)
        store.delete_file(record.id)
        return {"id": record.id, "object": "file", "deleted": True}

    return router


def _batches(store: Store, queue: Queue, settings: ServeSettings) -> APIRouter:
    """/v1/batches: create, list, look at and cancel."""
    router = APIRouter(prefix="/v1/batches")

    @router.post("")
    def create_batch(body: BatchCreate) -> dict[str, Any]:
        record = _new_batch(store, body, settings.model)
        store.add_batch(record)
        queue.wake()
        return record.api()

    @router.get("")
    def list_batches(after: str | None = None, limit: int = 20) -> dict[str, Any]:
        records, more = store.batches(after, max(1, min(limit, 100)))
        return page([r.api() for r in records], more)

    @router.get("/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        return _batch(store, batch_id).api()

    @router.post("/{batch_id}/cancel")
    def cancel(batch_id: str) -> dict[str, Any]:
        record = _batch(store, batch_id)
        if record.status in ("cancelling", "cancelled"):
            return record.api()
        cancelled = queue.cancel(record.id)
        if cancelled is None:
            raise ApiError(409, f"a batch that is {_batch(store, batch_id).status} cannot be cancelled", "id")
        return cancelled.api()

    return router


def _new_batch(store: Store, body: BatchCreate, model: str | None) -> BatchRecord:
    """A batch as created (validating), its request checked as the API checks it."""
    source = store.file(body.input_file_id)
    if source is None or source.purpose != "batch":
        raise ApiError(
            400, f"input_file_id {body.input_file_id!r} is not an uploaded batch file", "input_file_id"
        )
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    seconds = window_seconds(body.completion_window)
    if seconds is None:
        raise ApiError(
            400, "completion_window must be like 24h (s, m, h or d; at most 7d)", "completion_window"
        )
    now = int(time.time())
    return BatchRecord(
        id=store.new_batch_id(),
        input_file_id=source.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + seconds,
        metadata=body.metadata,
        model=model,
    )


def _pages(store: Store, settings: ServeSettings) -> APIRouter:
    """The status page, and the gallery of a batch's results."""
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    def status() -> HTMLResponse:
        batches, _ = store.batches(None, 100)
        files = {b.input_file_id: f for b in batches if (f := store.file(b.input_file_id)) is not None}
        return HTMLResponse(status_page(batches, files, settings.model))

    @router.get("/batches/{batch_id}/gallery", response_class=HTMLResponse)
    def gallery(batch_id: str) -> FileResponse:
        """`batchgen report`'s page of the batch's results, made when asked."""
        folder = store.batch_dir(_batch(store, batch_id).id)
        results = folder / "output.parquet"
        if not results.exists():
            raise ApiError(404, f"batch {batch_id[:80]} has no results yet", "id")
        write_gallery(results, folder / "gallery.html")
        return FileResponse(folder / "gallery.html", media_type="text/html")

    return router


def _kept(upload: UploadFile, store: Store, max_lines: int) -> FileRecord:
    """The uploaded file stored as sent, if it holds no more than `max_lines` requests."""
    upload.file.seek(0)
    lines = sum(1 for line in upload.file if line.strip())
    if lines > max_lines:
        raise ApiError(400, f"the file holds {lines} requests; at most {max_lines}", "file")
    upload.file.seek(0)
    file_id = store.new_file_id()
    path = store.file_path(file_id)
    atomic_write(path, lambda p: _copied(upload, p))
    size = path.stat().st_size
    name = (upload.filename or "upload.jsonl")[:255]
    record = FileRecord(
        id=file_id, bytes=size, created_at=int(time.time()), filename=name, purpose="batch", lines=lines
    )
    store.add_file(record)
    return record


def _copied(upload: UploadFile, path: Path) -> None:
    upload.file.seek(0)
    with open(path, "wb") as f:
        shutil.copyfileobj(upload.file, f, 1 << 20)


async def _form(request: Request, limit: int) -> FormData:
    """The multipart form, counted as it streams: 413 past `limit` bytes, before it is all read."""
    declared = request.headers.get("content-length") or "0"
    if declared.isdigit() and int(declared) > limit + 65536:  # refused before a byte is read
        raise ApiError(413, f"the upload is over the {limit}-byte limit", "file")

    async def counted() -> AsyncGenerator[bytes, None]:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit + 65536:  # the form's own headers beside the file's bytes
                raise ApiError(413, f"the upload is over the {limit}-byte limit", "file")
            yield chunk

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "a multipart/form-data upload is expected", "file")
    try:
        form = await MultiPartParser(request.headers, counted(), max_files=1, max_fields=4).parse()
    except MultiPartException as e:
        raise ApiError(400, f"the upload is not a valid form: {e.message}", "file") from None
    upload = form.get("file")
    if isinstance(upload, UploadFile):
        upload.file.seek(0, 2)
        if upload.file.tell() > limit:
            await form.close()
            raise ApiError(413, f"the upload is over the {limit}-byte limit", "file")
    return form

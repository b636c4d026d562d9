"""The OpenAI Batch format, both ways: request lines in, response lines out.

Input lines look like `{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"body": {"model", "messages", "max_tokens", ...}}`; `custom_id` becomes the row id and the
body's messages and sampling fields become the row's. The body's `model` is not used:
batchgen generates with the model it was given. Output lines follow the Batch API's output
file: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from .params import OPENAI_FIELDS

__all__ = ["is_batch_request", "row_id", "from_batch_request", "write_batch_output"]


def is_batch_request(value: Any) -> bool:
    return isinstance(value, dict) and "custom_id" in value and isinstance(value.get("body"), dict)


def row_id(value: dict[str, Any]) -> Any:
    """The id a row carries: a Batch request's `custom_id`, else its own `id`."""
    return value["custom_id"] if is_batch_request(value) else value.get("id")


def from_batch_request(value: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The row a request line stands for, and the problems that make it unusable."""
    problems = []
    if value.get("url", "/v1/chat/completions") != "/v1/chat/completions":
        problems.append(
            ("url", f"only /v1/chat/completions requests are supported, got {value.get('url')!r}")
        )
    if value.get("method", "POST") != "POST":
        problems.append(("method", f"expected POST, got {value.get('method')!r}"))
    body = value["body"]
    row: dict[str, Any] = {"id": value["custom_id"], "messages": body.get("messages")}
    for name, ours in OPENAI_FIELDS.items():
        if body.get(name) is not None:
            row[ours] = body[name]
    return row, problems


def _request_id(custom_id: Any) -> str:
    return hashlib.sha256(str(custom_id).encode()).hexdigest()[:24]


def write_batch_output(table: pa.Table, path: Path) -> None:
    """One output line per row, in row order; failed rows carry `error`, not `response`."""
    from .write import atomic_write  # here: the reader imports this module, the writer the reader

    created = int(time.time())
    lines = []
    for row in table.to_pylist():
        custom_id = row.get("custom_id", row["id"])
        rid = _request_id(custom_id)
        line: dict[str, Any] = {
            "id": f"batch_req_{rid}",
            "custom_id": custom_id,
            "response": None,
            "error": None,
        }
        if row["status"] == "ok":
            usage = {
                "prompt_tokens": row["prompt_tokens"],
                "completion_tokens": row["completion_tokens"],
                "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]},
            }
            line["response"] = {
                "status_code": 200,
                "request_id": rid,
                "body": {
                    "id": f"chatcmpl-{rid}",
                    "object": "chat.completion",
                    "created": created,
                    "model": row["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": row["generated_text"]},
                            "finish_reason": row["finish_reason"],
                        }
                    ],
                    "usage": usage,
                },
            }
        else:
            line["error"] = {"code": f"{row['error_stage']}_error", "message": row["error"]}
        lines.append(json.dumps(line) + "\n")
    atomic_write(path, lambda p: p.write_text("".join(lines)))

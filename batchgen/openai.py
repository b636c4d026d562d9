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


# Body fields that do not change the answer: taken and left alone.
_HARMLESS = {"model", "user", "metadata", "store", "service_tier", "messages"}
# Fields whose default (or these values) asks nothing of the engine; any other value is refused.
_ONLY_DEFAULT = {"stream": (False,), "logprobs": (False,), "top_logprobs": (0,),
                 "parallel_tool_calls": (True, False)}  # fmt: skip
_TAKEN = {"response_format"}  # carried to the row as they are (parse.constraint_of reads it)


def from_batch_request(value: dict[str, Any]) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """The row a request line stands for, and the problems that make it unusable: a field
    batchgen would otherwise ignore is named, never answered as if it had been honoured. A
    request to another endpoint gives no row at all (None): that one problem is the answer."""
    if value.get("url", "/v1/chat/completions") != "/v1/chat/completions":
        return None, [
            ("url", f"only /v1/chat/completions requests are supported, got {value.get('url')!r:.80}")
        ]
    problems = []
    if value.get("method", "POST") != "POST":
        problems.append(("method", f"expected POST, got {value.get('method')!r:.40}"))
    body = value["body"]
    row: dict[str, Any] = {"id": value["custom_id"], "messages": body.get("messages")}
    named: dict[str, str] = {}  # parameter → the body field that gave it
    for name, field in body.items():
        if name in OPENAI_FIELDS:
            param = OPENAI_FIELDS[name]
            if field is None:
                continue
            if param in named and row[param] != field:  # max_tokens beside max_completion_tokens
                problems.append((f"body.{name}", f"{field!r:.30} but body.{named[param]} is "
                                                 f"{row[param]!r:.30}: give one of them"))  # fmt: skip
            row[param], named[param] = field, name
        elif name in _TAKEN:
            row[name] = field
        elif name in _ONLY_DEFAULT:
            if field is not None and field not in _ONLY_DEFAULT[name]:
                problems.append((f"body.{name}", f"{field!r:.60} is not supported by batchgen"))
        elif name not in _HARMLESS and field is not None:
            problems.append((f"body.{name}", "not supported by batchgen"))
    return row, problems


def _choices(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's completions: all n of them (`choices`), or its one."""
    if row.get("choices"):
        return json.loads(row["choices"])
    return [{"text": row["generated_text"], "finish_reason": row["finish_reason"]}]


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
                            "index": k,
                            "message": {"role": "assistant", "content": c["text"]},
                            "finish_reason": c["finish_reason"],
                        }
                        for k, c in enumerate(_choices(row))
                    ],
                    "usage": usage,
                },
            }
        else:
            line["error"] = {"code": f"{row['error_stage']}_error", "message": row["error"]}
        lines.append(json.dumps(line) + "\n")
    atomic_write(path, lambda p: p.write_text("".join(lines)))

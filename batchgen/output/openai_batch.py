"""OpenAI Batch response lines out: one per result row, as the Batch API's output file.

One line per result row:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..core.records import ResultRow
from .store import atomic_write, strict_json

__all__ = ["write_batch_output", "batch_lines", "error_line", "BatchOutput"]


def _choices(row: ResultRow) -> list[dict[str, Any]]:
    """A row's completions: all n of them (`choices`), or its one."""
    if row.get("choices"):
        return json.loads(row["choices"])
    return [
        {
            "text": row["generated_text"],
            "finish_reason": row["finish_reason"],
            "logprobs": row.get("logprobs"),
            "reasoning": row.get("reasoning"),
            "tool_calls": row.get("tool_calls"),
        }
    ]


def _message(choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant's message: the answer, its tool calls (content null when they are all it
    said, as the API writes it), and a thinking model's reasoning apart as the
    OpenAI-compatible servers (vLLM, mlx-lm's) return it."""
    calls = choice.get("tool_calls")
    message: dict[str, Any] = {"role": "assistant", "content": choice["text"] or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if choice.get("reasoning") is not None:
        message["reasoning_content"] = choice["reasoning"]
    return message


def _token(record: dict[str, Any]) -> dict[str, Any]:
    return {"token": record["token"], "logprob": record["logprob"], "bytes": list(record["token"].encode())}


def _logprobs(records: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The API's `choices[].logprobs`: per token its text, logprob, UTF-8 bytes and the top
    alternatives alike (a token that is part of a character decodes to U+FFFD: its bytes are those)."""
    if records is None:
        return None
    return {
        "content": [
            {**_token(r), "top_logprobs": [_token(t) for t in r["top_logprobs"] or []]} for r in records
        ],
        "refusal": None,
    }


def _request_id(custom_id: object) -> str:
    return hashlib.sha256(str(custom_id).encode()).hexdigest()[:24]


def write_batch_output(table: pa.Table, path: Path) -> None:
    """One output line per row, in row order; failed rows carry `error`, not `response`."""
    lines = batch_lines(table)
    atomic_write(path, lambda p: p.write_text("".join(lines)))


def batch_lines(table: pa.Table) -> list[str]:
    """Each row's response line (newline-ended), in row order."""
    created = int(time.time())
    lines = []
    for row in table.to_pylist():
        custom_id = row.get("custom_id", row["id"])
        if row["status"] != "ok":
            lines.append(error_line(custom_id, f"{row['error_stage']}_error", row["error"]))
            continue
        rid = _request_id(custom_id)
        usage = {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]},
        }
        if row.get("reasoning_tokens"):
            usage["completion_tokens_details"] = {"reasoning_tokens": row["reasoning_tokens"]}
        response = {
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
                        "message": _message(c),
                        # a scored row (score_only), a row the loop stop ended: the API knows no such
                        # reasons; the Parquet keeps them
                        "finish_reason": "stop"
                        if c["finish_reason"] in ("score", "repetition")
                        else c["finish_reason"],
                        "logprobs": _logprobs(c.get("logprobs")),
                    }
                    for k, c in enumerate(_choices(row))
                ],
                "usage": usage,
            },
        }
        line = {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": response, "error": None}
        lines.append(strict_json(line) + "\n")
    return lines


def error_line(custom_id: object, code: str, message: str) -> str:
    """A request's line that carries `error` ({code, message}), not `response`."""
    line = {
        "id": f"batch_req_{_request_id(custom_id)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return strict_json(line) + "\n"


@dataclass(frozen=True, slots=True)
class BatchOutput:
    """The OpenAI Batch output file at `path`, a writer's sink: made from the finished output."""

    path: Path

    def write(self, table: pa.Table) -> None:
        write_batch_output(table, self.path)

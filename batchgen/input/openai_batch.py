"""OpenAI Batch request lines in (responses go out through output/openai_batch.py).

Input lines look like `{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"body": {"model", "messages", "max_tokens", ...}}`; `custom_id` becomes the row id and the
body's messages and sampling fields become the row's. The body's `model` is not used:
batchgen generates with the model it was given.
"""

from __future__ import annotations

from ..core.params import OPENAI_FIELDS

__all__ = ["is_batch_request", "row_id", "from_batch_request"]


def is_batch_request(value: object) -> bool:
    return isinstance(value, dict) and "custom_id" in value and isinstance(value.get("body"), dict)


def row_id(value: dict[str, object]) -> object:
    """The id a row carries: a Batch request's `custom_id`, else its own `id`."""
    return value["custom_id"] if is_batch_request(value) else value.get("id")


# Body fields that do not change the answer: taken and left alone.
_HARMLESS = {"model", "user", "metadata", "store", "service_tier", "messages"}
# Fields whose default (or these values) asks nothing of the engine; any other value is refused.
_ONLY_DEFAULT = {"stream": (False,), "parallel_tool_calls": (True, False)}
_TAKEN = {"response_format"}  # carried to the row as they are (parse.constraint_of reads it)


def from_batch_request(value: dict[str, object]) -> tuple[dict[str, object] | None, list[tuple[str, str]]]:
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
    body = value["body"] if isinstance(value["body"], dict) else {}  # a dict: is_batch_request said so
    row: dict[str, object] = {"id": value["custom_id"], "messages": body.get("messages")}
    named: dict[str, str] = {}  # parameter → the body field that gave it
    for name, field in body.items():
        if name in OPENAI_FIELDS:
            param = OPENAI_FIELDS[name]
            if field is None:
                continue
            if param in named and row[param] != field:  # max_tokens beside max_completion_tokens
                problems.append(
                    (
                        f"body.{name}",
                        f"{field!r:.30} but body.{named[param]} is {row[param]!r:.30}: give one of them",
                    )
                )
            row[param], named[param] = field, name
        elif name in _TAKEN:
            row[name] = field
        elif name in _ONLY_DEFAULT:
            if field is not None and field not in _ONLY_DEFAULT[name]:
                problems.append((f"body.{name}", f"{field!r:.60} is not supported by batchgen"))
        elif name not in _HARMLESS and field is not None:
            problems.append((f"body.{name}", "not supported by batchgen"))
    return row, problems

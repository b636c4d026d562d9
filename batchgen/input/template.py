"""A --prompt-template: the columns it names and a row's prompt made from it.

A field is a column by its whole name first (a staged job's dotted ones,
`{caption.generated_text}`), else a column and an index or attribute into it, none that starts
with `_`: a template reads values, it does not walk an object's insides.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Collection
from typing import Any

from ..core.errors import ConfigError
from ..core.rules import Problem

__all__ = ["fill_template", "fields_of", "template_fields", "has_field"]


class _Template(string.Formatter):
    """The fields as the module says: whole names first, no `_` parts."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        if field_name in kwargs:
            return kwargs[field_name], field_name
        if any(part.startswith("_") for part in re.split(r"[.\[\]]", field_name)[1:]):
            raise ValueError(f"field {field_name!r}: no part of a field starts with '_'")
        return super().get_field(field_name, args, kwargs)

    def get_value(self, key: Any, args: Any, kwargs: Any) -> Any:
        if key not in kwargs:
            raise KeyError(key)
        return kwargs[key]


def fill_template(template: str, value: dict[str, object], problems: list[Problem]) -> dict[str, object]:
    """The row with `prompt` made from the template and the row's own columns."""
    if value.get("messages") is not None:
        problems.append(("prompt_template", "a row with 'messages' cannot take a prompt template"))
        return value
    try:
        prompt = _Template().vformat(template, (), {k: "" if v is None else v for k, v in value.items()})
    except KeyError as e:
        problems.append(("prompt_template", f"missing column {e.args[0]!r}"))
        return value
    except (ValueError, IndexError, AttributeError, TypeError) as e:
        problems.append(("prompt_template", f"cannot fill it ({e})"))
        return value
    return {**value, "prompt": prompt}


@functools.lru_cache(maxsize=64)
def fields_of(template: str | None) -> tuple[str, ...]:
    try:
        return tuple(template_fields(template)) if template else ()
    except ConfigError:
        return ()


def template_fields(template: str) -> list[str]:
    """The columns a --prompt-template names, each as written up to an index (a stage's
    dotted column whole: `caption.generated_text`); a malformed one is a ConfigError."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ConfigError(f"--prompt-template {template!r:.80}: malformed ({e})") from None
    names = [name.split("[", 1)[0] for name in fields]
    if any(not name or name.split(".", 1)[0].isdigit() or not name.split(".", 1)[0] for name in names):
        raise ConfigError(f"--prompt-template {template!r:.80}: every field names a column, e.g. {{caption}}")
    return names


def has_field(columns: Collection[str], name: str) -> bool:
    """Whether a template's field finds its column: the whole dotted name, or its first part
    (a column with an attribute or key read from it)."""
    return name in columns or name.split(".", 1)[0] in columns

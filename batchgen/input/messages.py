"""A row's turns and media: content parts into messages, media references in prompt-slot order."""

from __future__ import annotations

from ..core.records import MediaKind, MediaRef, Message, Part
from ..core.rules import Problem

__all__ = [
    "PART_TYPES",
    "source_of",
    "media_values",
    "part_reference",
    "messages_of",
    "attach_flat_media",
    "in_slot_order",
]

# OpenAI content-part types and (kind, key holding the reference).
PART_TYPES: dict[str, tuple[MediaKind, str]] = {
    "image_url": ("image", "image_url"),
    "image": ("image", "image"),
    "video_url": ("video", "video_url"),
    "video": ("video", "video"),
    "audio_url": ("audio", "audio_url"),
    "audio": ("audio", "audio"),
}
_ROLES = {"system", "user", "assistant", "tool", "developer"}


def source_of(value: object) -> str | bytes | None:
    """A media reference from a cell: a URL, path or data URL; raw bytes (a Parquet binary
    column); a Hugging Face image struct, its bytes first, else its path."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value) if len(value) else None
    if isinstance(value, dict):
        return source_of(value.get("bytes")) or source_of(value.get("path"))
    return None


def media_values(name: str, value: object, problems: list[Problem]) -> list[str | bytes]:
    values = value if isinstance(value, list) else [value]
    found = [source_of(v) for v in values]
    sources = [s for s in found if s]
    if not sources or len(sources) < len(found):
        problems.append(
            (
                name,
                f"expected a URL, path, data URL, bytes or {{bytes, path}} struct, or a list of them, "
                f"got {_shown(value)}",
            )
        )
        return []
    return sources


def _shown(value: object) -> str:
    """A bad value for a message: bytes (also inside a struct) by their size, not their content."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in list(value.items())[:4]) + "}"
    return f"{value!r:.60}"


def part_reference(part: dict[str, object], key: str) -> str | bytes | None:
    ref = part.get(key)
    return source_of(ref.get("url") if isinstance(ref, dict) and "url" in ref else ref)


def _content(
    content: object, where: str, media: list[MediaRef], problems: list[Problem]
) -> list[Part] | str | None:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        problems.append((where, f"content must be a string or a list of parts, got {content!r:.60}"))
        return None
    parts: list[Part] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in PART_TYPES:
            media_kind, key = PART_TYPES[kind]
            ref = part_reference(part, key)
            if ref is None:
                problems.append((at, f"a {kind} part needs a URL, path, data URL or bytes in {key!r}"))
                continue
            parts.append({"type": media_kind, "media": len(media)})
            media.append(MediaRef(media_kind, ref))
        elif kind == "text":
            problems.append((at, "a text part needs a string 'text'"))
        else:
            problems.append((at, f"unknown content part type {kind!r}"))
    return parts


def messages_of(value: object, media: list[MediaRef], problems: list[Problem]) -> list[Message]:
    if not isinstance(value, list) or not value:
        problems.append(("messages", "expected a non-empty list of {role, content} objects"))
        return []
    messages: list[Message] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            problems.append((where, f"expected {{role, content}} with role in {sorted(_ROLES)}"))
            continue
        content = _content(message.get("content"), where, media, problems)
        if content is not None:
            messages.append({"role": message["role"], "content": content})
    return messages


def attach_flat_media(messages: list[Message], flat: list[MediaRef], media: list[MediaRef]) -> None:
    """Flat media go first in the first user turn: the shared prefix of rows on one image."""
    target = next((m for m in messages if m["role"] == "user"), None)
    if target is None:
        target = {"role": "user", "content": []}
        messages.append(target)
    content = target["content"]
    parts: list[Part] = [{"type": "text", "text": content}] if isinstance(content, str) else content
    head: list[Part] = []
    for ref in flat:
        head.append({"type": ref.kind, "media": len(media)})
        media.append(ref)
    target["content"] = head + parts


def in_slot_order(messages: list[Message], media: list[MediaRef]) -> list[MediaRef]:
    """The media in the order their parts come in the prompt, parts renumbered to match: the
    processor fills the prompt's slots with the images in list order, so a flat image put
    ahead of the messages' own must come first in the list too."""
    ordered: list[MediaRef] = []
    for message in messages:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if "media" in part:
                    ordered.append(media[part["media"]])
                    part["media"] = len(ordered) - 1
    return ordered

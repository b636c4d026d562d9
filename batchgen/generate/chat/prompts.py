"""Prompts: chat templates applied to a row's messages, and where prompts may be shared."""

from __future__ import annotations

import dataclasses
from typing import Any

from PIL import Image

from ...core.errors import RowError
from ...core.params import GenParams
from ...core.records import Job, Media, MediaItem, Message
from ..base.arrays import ModelConfig, TemplateOwner, Tokenizer
from ..base.models import ModelInfo
from .reasoning import Markers

__all__ = [
    "END_OF_TURN",
    "apply_template",
    "render",
    "template_of",
    "template_kwargs",
    "text_only",
    "template_parts",
    "frames_as_images",
    "message_bounds",
    "after_media",
    "check_length",
]

END_OF_TURN = "<|im_end|>"  # Qwen-style templates end a turn here even when eos differs


# Chat templates seen to drop a message whose content is a plain string (mlx-vlm's InternVL
# template walks the content as a list of parts, so a string system prompt vanished; iterating
# its characters also made it the slowest step of a row): their rows are rendered as parts.
_WANTS_PARTS: set[str] = set()


def apply_template(
    template_owner: TemplateOwner, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> str:
    """The prompt as the checkpoint's chat template renders it, with every message's text in it."""
    key = str(getattr(template_owner, "chat_template", None))
    if key in _WANTS_PARTS:
        return _render(template_owner, _as_parts(messages), kwargs)
    prompt = _render(template_owner, messages, kwargs)
    if _all_text_in(prompt, messages):
        return prompt
    retry = _render(template_owner, _as_parts(messages), kwargs)
    if not _all_text_in(retry, messages) or "'type': 'text'" in retry:  # not a template for parts either
        return prompt
    _WANTS_PARTS.add(key)
    return retry


def template_of(template_owner: TemplateOwner) -> str:
    """The chat template a tokenizer or processor renders with ("" without one)."""
    for owner in (template_owner, getattr(template_owner, "tokenizer", None)):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, str):
            return template
    return ""


def template_kwargs(template_owner: TemplateOwner, p: GenParams, markers: Markers | None) -> dict[str, Any]:
    """The row's template keywords: its tools (unless tool_choice is none), refused by a
    template that never renders them, and its `thinking` as `enable_thinking`, where the
    template takes one and the row's own keywords do not say it already. Unset, thinking is
    what mlx-lm's tokenizer renders (on for a model with thinking `markers`), on every lane:
    mlx-vlm's own rendering would fill in false."""
    kwargs = p.chat_template_kwargs
    if p.tools and p.tool_choice != "none":
        if "tools" not in template_of(template_owner):
            raise RowError("generate", "the row has tools, but the model's chat template never shows them")
        kwargs = {**kwargs, "tools": list(p.tools)}
    if "enable_thinking" in kwargs or "enable_thinking" not in template_of(template_owner):
        return kwargs
    thinking = p.thinking
    if thinking is None:
        thinking = markers is not None
    return {**kwargs, "enable_thinking": thinking}


def render(
    template_owner: TemplateOwner, messages: list[dict[str, Any]], p: GenParams, markers: Markers | None
) -> str:
    """The row's prompt with its thinking on or off: through the template's enable_thinking,
    or, with thinking off where the template has none, an empty closed block after it (the end
    of the block where the template opened one), so a thinking model answers at once."""
    prompt = apply_template(template_owner, messages, template_kwargs(template_owner, p, markers))
    if p.thinking is False and markers is not None and "enable_thinking" not in template_of(template_owner):
        prompt += markers.block(prompt.rfind(markers.start) > prompt.rfind(markers.end))
    return prompt


def _render(template_owner: TemplateOwner, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    from mlx_vlm.prompt_utils import get_chat_template

    try:
        return get_chat_template(template_owner, messages, True, **kwargs)
    except Exception:
        if not kwargs or "tools" in kwargs:  # the tools are never dropped unseen
            raise
        # A template that rejects an extra keyword still renders without it.
        return get_chat_template(template_owner, messages, True)


def _all_text_in(prompt: str, messages: list[dict[str, Any]]) -> bool:
    return all(m["content"].strip() in prompt for m in messages if isinstance(m["content"], str))


def _as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """String contents as one text part (under `text` and `content`, as template_parts writes them)."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"], "content": m["content"]}]}
        if isinstance(m["content"], str)
        else m
        for m in messages
    ]


def text_only(messages: list[Message]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = "".join(p["text"] for p in content if p["type"] == "text")
        out.append({"role": m["role"], "content": content})
    return out


def template_parts(messages: list[Message]) -> list[dict[str, Any]]:
    """Media parts as the chat templates expect them: `{"type": "image"}` and friends. A text
    part also carries its text as `content`: some templates read that key (mlx-vlm's InternVL
    processor brings its own template, which would drop every question otherwise)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m["content"]
        shown: str | list[dict[str, Any]] = (
            content
            if isinstance(content, str)
            else [
                {**p, "content": p["text"]} if p["type"] == "text" else {"type": p["type"]} for p in content
            ]
        )
        out.append({"role": m["role"], "content": shown})
    return out


def frames_as_images(job: Job, media: Media) -> tuple[Job, Media]:
    """A row's videos as a model without a video token takes them: each video's sampled frames
    as images in its place, its part in the messages one image part a frame, so the template
    gives every frame its own image slot (mlx-vlm handed such a model the frames with no slot
    for them: some processors refused the row, others answered without the video). A frame's
    digest is its video's and its index, so questions on one clip still share its frames."""
    if not media.videos:
        return job, media
    items: list[MediaItem] = []
    counts: list[int] = []  # frames of each video, in order
    for item in media.items:
        if item.kind != "video":
            items.append(item)
            continue
        counts.append(len(item.payload))
        items += [
            MediaItem("image", Image.fromarray(frame), f"{item.digest}:{k}")
            for k, frame in enumerate(item.payload)
        ]
    frames = iter(counts)
    messages: list[Message] = []
    for m in job.messages:
        content = m["content"]
        if isinstance(content, str):
            messages.append(m)
            continue
        parts: list[Any] = []
        for part in content:
            parts += [{**part, "type": "image"}] * next(frames) if part["type"] == "video" else [part]
        messages.append({**m, "content": parts})
    return dataclasses.replace(job, messages=messages), Media(items)


def after_media(ids: list[int], config: ModelConfig) -> list[int]:
    """Positions just past each media block: the prefix every question on that image shares."""
    end_id = getattr(config, "vision_end_token_id", None)
    if end_id is None:
        end_id = getattr(config, "vision_start_token_id", -2) + 1
    return [i + 1 for i, t in enumerate(ids) if t == end_id]


def message_bounds(tokenizer: Tokenizer, messages: list[dict], kwargs: dict, ids: list[int]) -> list[int]:
    """Where each turn but the last ends in the prompt's tokens: a shared system prompt or
    few-shot turns are a prefix that other rows reuse. Turns whose rendering is not a clean
    token prefix of the whole (a template that rewrites history) give no boundary."""
    bounds = []
    for k in range(1, len(messages)):
        try:
            head = tokenizer.apply_chat_template(
                messages[:k], tokenize=False, add_generation_prompt=False, **kwargs
            )
        except Exception:
            break
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        if 0 < len(head_ids) < len(ids) and ids[: len(head_ids)] == head_ids:
            bounds.append(len(head_ids))
    return bounds


def check_length(prompt: str, ids: list[int] | None, info: ModelInfo) -> None:
    """A prompt longer than the model's context is a row error; an absurdly long one is
    refused from its characters, before it costs a tokenization."""
    limit = info.context
    if not limit:
        return
    if ids is None and len(prompt) > limit * 16:  # no tokenizer averages 16 characters a token
        raise RowError(
            "generate", f"prompt of {len(prompt)} characters cannot fit the model's context of {limit} tokens"
        )
    if ids is not None and len(ids) >= limit:
        raise RowError("generate", f"prompt of {len(ids)} tokens does not fit the model's context of {limit}")

"""Turn a raw row into a Job: chat messages with ordered media parts, checked parameters."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections import Counter
from typing import Any, Protocol

from ..core.constraints import CONSTRAINT_FIELDS, constraint_of, with_tool_choice
from ..core.errors import short
from ..core.params import OPENAI_FIELDS, PARAMS, Constraint, GenParams, check_params
from ..core.records import MEDIA_COLUMNS, Job, MediaRef, Scoring
from ..core.rules import MOST_SCORED, Problem, is_int, is_number
from ..core.settings import SET_NAME, Columns
from .messages import (
    PART_TYPES,
    attach_flat_media,
    in_slot_order,
    media_values,
    messages_of,
    part_reference,
    source_of,
)
from .openai_batch import from_batch_request, is_batch_request
from .read import RawRow, valid_id
from .template import fields_of, fill_template

__all__ = [
    "parse_row",
    "parse_job",
    "Reading",
    "asked",
    "shared_parts",
    "media_like",
    "near_miss",
    "FIELDS",
]

# Names of columns that usually hold media (img2dataset's `jpg`, web crawls' `url`): a row
# without media beside one of them is probably a mapping the user forgot.
_MEDIA_NAMES = {
    "jpg",
    "jpeg",
    "png",
    "webp",
    "img",
    "image_url",
    "image_path",
    "image_bytes",
    "url",
    "mp4",
    "video_url",
    "picture",
    "photo",
}


# Every field a row's value can give batchgen: its parts, its parameters, its constraint.
FIELDS = frozenset(
    {
        "id",
        "prompt",
        "messages",
        *MEDIA_COLUMNS,
        *(p.name for p in PARAMS),
        *OPENAI_FIELDS,
        *CONSTRAINT_FIELDS,
        "video_fps",
        "video_max_frames",
        "choices_to_score",
        "score_text",
        "adapter",
        "model",
    }
)


def _scoring(
    value: dict[str, object], params: GenParams, constraint: Constraint | None, problems: list[Problem]
) -> Scoring | None:
    """The answers a row asks to be scored: its (or the run's) `choices_to_score`, else a
    guided_choice's choices; and `score_text`. A choice given twice is refused (scores keep
    the choices' positions; params refuses a repeated choices_to_score)."""
    choices: Any = params.choices_to_score or None
    asked = choices is not None
    if choices is None and constraint is not None and constraint.kind == "choice":
        given = json.loads(constraint.spec)
        choices = given if len(given) <= MOST_SCORED else None  # a longer list constrains, unscored
        if choices is None and params.score_only:
            problems.append(
                (
                    "score_only",
                    f"a guided_choice of {len(given):,} choices is over the {MOST_SCORED} that can be scored",
                )
            )
    twice = [c for c, n in Counter(choices or ()).items() if n > 1]
    if twice:
        problems.append(("guided_choice", f"{twice[0]!r:.60} given twice: give each answer once"))
        choices = None
    text = value.get("score_text")
    if text is not None and not isinstance(text, str):
        problems.append(("score_text", f"expected a string, got {text!r:.60}"))
        text = None
    if not choices and text is None:
        return None
    return Scoring(choices=tuple(choices or ()), text=text, asked=asked or text is not None)


@functools.lru_cache(maxsize=4096)  # a job has a few column names; a hostile one's many stay bounded
def near_miss(name: str) -> str | None:
    """The field batchgen reads that `name` is one slip away from (`max_token` → `max_tokens`,
    `imgae` → `image`), if any: such a column is carried as data, so the run says so."""
    if name in FIELDS or not 3 <= len(name) <= 40:
        return None
    near = difflib.get_close_matches(name.lower(), FIELDS, 1, 0.8)
    return near[0] if near and near[0] != name else None


def media_like(name: str, value: object) -> bool:
    """A column value that looks like media: bytes, a Hugging Face image struct, or a name like `jpg`."""
    if value is None:
        return False
    if isinstance(value, (bytes, bytearray, memoryview)):
        return True
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        return True
    return name.lower() in _MEDIA_NAMES


def _mapped(value: dict[str, object], columns: Columns, problems: list[Problem]) -> dict[str, object]:
    """The row under batchgen's own column names: the mapped id, prompt and system columns,
    and the mapped media columns in place of `image(s)` / `video(s)`."""
    out = dict(value)
    for key, name in (
        ("id", columns.id),
        ("prompt", columns.prompt),
        ("system", columns.system),
        ("score_text", columns.score),
    ):
        if name:
            out[key] = value.get(name)
    for kind, names in (("image", columns.image), ("video", columns.video)):
        if not names:
            continue
        found: list[object] = []
        for name in names:
            cell = value.get(name)
            found += cell if isinstance(cell, list) else [] if cell is None else [cell]
        out.pop(kind + "s", None)
        out[kind] = found or None
        if not found:
            problems.append((names[0], f"no {kind} in {' or '.join(map(repr, names))} (empty)"))
    return out


def shared_parts(value: object, columns: Columns) -> tuple[list[tuple[str, str | bytes]], Any]:
    """What a row could share with others, read as parse_row reads it but checking nothing:
    its media references in prompt order ((kind, source): flat columns first, as the prompt
    has them) and its text before the last turn (system prompt, earlier turns). The plan's
    share keys come from it, for every row of a job, so it costs a few microseconds."""
    if not isinstance(value, dict):
        return [], None
    if is_batch_request(value):
        value = {"messages": value["body"].get("messages")}
    if columns.named():
        value = _mapped(value, columns, [])
    media: list[tuple[str, str | bytes]] = []
    for name, kind in MEDIA_COLUMNS.items():
        cell = value.get(name)
        for v in cell if isinstance(cell, list) else [] if cell is None else [cell]:
            if (source := source_of(v)) is not None:
                media.append((kind, source))
    messages = value.get("messages")
    if not isinstance(messages, list):
        return media, value.get("system")
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in PART_TYPES:
                kind, key = PART_TYPES[part["type"]]
                if (source := part_reference(part, key)) is not None:
                    media.append((kind, source))
    return media, [value.get("system"), messages[:-1]] if len(messages) > 1 else value.get("system")


def parse_row(
    row: RawRow, defaults: GenParams, template: str | None = None, columns: Columns | None = None
) -> tuple[Job, list[Problem]]:
    """A Job for every row; the problems found, if any, are also in `job.error`. Never raises:
    whatever a hostile row makes go wrong is that row's problem.

    `template` (`--prompt-template`) fills each row's prompt from its columns; `columns` says
    which columns hold the id, prompt, system prompt and media."""
    try:
        return _parse_row(row, defaults, template, columns or Columns())
    except Exception as e:  # noqa: BLE001 - a safety net under the checks below
        problem = ("row", f"cannot read it ({type(e).__name__}: {short(e)})")
        job = Job(index=row.index, id=row.id, line=row.line, error=problem[1])
        return job, [problem]


class Reading(Protocol):
    """What reading a row takes from a run's settings (a RunConfig or an executor's WorkSettings)."""

    @property
    def defaults(self) -> GenParams: ...

    @property
    def prompt_template(self) -> str | None: ...

    @property
    def columns(self) -> Columns: ...


def parse_job(row: RawRow, settings: Reading) -> Job:
    """A pending row's Job as the run reads it (its problems in `job.error`)."""
    return parse_row(row, settings.defaults, settings.prompt_template, settings.columns)[0]


def _parse_row(
    row: RawRow, defaults: GenParams, template: str | None, columns: Columns
) -> tuple[Job, list[Problem]]:
    job = Job(index=row.index, id=row.id, line=row.line, digest=row.digest)
    if row.error:
        job.error = row.error
        job.raw = row.value if isinstance(row.value, dict) else {}  # what could be read is carried
        return job, [("row", row.error)]
    value = row.value
    if not isinstance(value, dict):
        problem = ("row", f"expected a JSON object, got {type(value).__name__}")
        job.error = problem[1]
        return job, [problem]
    job.raw = value
    problems: list[Problem] = []
    if is_batch_request(value):
        request, batch_problems = from_batch_request(value)
        problems += batch_problems
        if request is None:  # another endpoint: nothing else about the line matters
            job.error = "; ".join(f"{field}: {msg}" for field, msg in problems)
            return job, problems
        value = request
        body_model = job.raw["body"].get("model")
        job.asked_model = body_model if isinstance(body_model, str) else None
    if columns.named():
        value = _mapped(value, columns, problems)
    if template is not None:
        value = fill_template(template, value, problems)
    if not (value.get("id") is None or valid_id(value["id"])):
        problems.append(("id", f"expected a string or an integer, got {value['id']!r:.60}"))
    _parameters(job, value, defaults, problems)
    if columns.model is not None:  # the run has a set of models: the row names its own
        job.model = _model_name(job.asked_model if job.asked_model else value.get(columns.model), problems)
        job.asked_model = None  # honoured, not ignored
    _turns(job, value, problems)
    mapped = {c for _, c in columns.named()} | set(fields_of(template))
    if not job.media and not is_batch_request(job.raw):  # a Batch line's `url` is its endpoint
        job.unused_media = tuple(k for k, v in job.raw.items() if k not in mapped and media_like(k, v))
    job.near_misses = tuple(k for k in job.raw if isinstance(k, str) and k not in mapped and near_miss(k))
    if problems:
        job.error = "; ".join(f"{field}: {msg}" for field, msg in problems)
    return job, problems


def _parameters(job: Job, value: dict[str, object], defaults: GenParams, problems: list[Problem]) -> None:
    """The row's generation parameters, output constraint, scores and frame sampling."""
    param_problems, job.params = check_params(value, defaults)
    problems += param_problems
    constraint = constraint_of(value, problems)
    constraint = with_tool_choice(job.params, constraint, problems)
    if constraint is not None:
        job.params = dataclasses.replace(job.params, constraint=constraint)
    before = len(problems)
    job.scoring = _scoring(value, job.params, constraint, problems)
    if job.params.score_only and job.scoring is None and len(problems) == before:  # none said why
        problems.append(
            ("score_only", "nothing to score: give choices_to_score, guided_choice or score_text")
        )
    fps, max_frames = value.get("video_fps"), value.get("video_max_frames")
    if fps is not None and not (is_number(fps) and fps > 0):
        problems.append(("video_fps", f"expected a number > 0, got {fps!r:.60}"))
    elif fps is not None:
        job.video_fps = float(fps)
    if max_frames is not None and not (is_int(max_frames) and max_frames >= 2):
        problems.append(("video_max_frames", f"expected an integer >= 2, got {max_frames!r:.60}"))
    elif max_frames is not None:
        job.video_max_frames = max_frames
    adapter = value.get("adapter")  # a name of the run's set, or a folder (the router tells which)
    if adapter is not None and not (
        isinstance(adapter, str) and 0 < len(adapter) <= 1024 and adapter.isprintable()
    ):
        problems.append(("adapter", f"expected an adapter's name or folder, got {adapter!r:.60}"))
    elif adapter is not None:
        job.adapter = adapter


def _model_name(value: object, problems: list[Problem]) -> str | None:
    """A row's choice of one of the run's models, by name (the router checks it is one)."""
    if value is not None and not (isinstance(value, str) and SET_NAME.fullmatch(value)):
        problems.append(("model", f"expected a model's name (letters, digits, _ . : / -), got {value!r:.60}"))
        return None
    return value


def _turns(job: Job, value: dict[str, object], problems: list[Problem]) -> None:
    """The row's messages (from `prompt` or `messages`, its system prompt first) and its media
    in the order the prompt's slots take them, flat media columns first."""
    prompt, messages = value.get("prompt"), value.get("messages")
    media: list[MediaRef] = []
    if prompt is not None and messages is not None:
        problems.append(("prompt", "give either 'prompt' or 'messages', not both"))
    elif messages is not None:
        job.messages = messages_of(messages, media, problems)
    elif isinstance(prompt, str):
        job.messages = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        problems.append(("prompt", f"expected a string, got {prompt!r:.60}"))
    else:
        problems.append(("prompt", "missing: a row needs 'prompt' or 'messages'"))
    flat: list[MediaRef] = []
    for name, kind in MEDIA_COLUMNS.items():
        if value.get(name) is not None:
            flat += [MediaRef(kind, v) for v in media_values(name, value[name], problems)]
    if flat and job.messages:
        attach_flat_media(job.messages, flat, media)
    job.media = in_slot_order(job.messages, media)
    system = job.params.system
    if system and job.messages and job.messages[0]["role"] != "system":
        job.messages.insert(0, {"role": "system", "content": system})


def asked(
    value: Any, template: str | None = None, columns: Columns | None = None
) -> tuple[str, list[MediaRef]]:
    """What a row asked, read as a run reads it (its column mapping, its prompt template): the
    text of its turns but the system prompt, and its media in prompt order. For readers of
    results (the gallery, export); a row that does not parse asks what could be read of it."""
    job, _ = parse_row(RawRow(0, None, value, fingerprint=""), GenParams(), template, columns)
    texts: list[str] = []
    for message in job.messages:
        content = message["content"]
        if message["role"] != "system":
            texts += [content] if isinstance(content, str) else [p["text"] for p in content if "text" in p]
    return " ".join(texts), job.media

"""The records that cross stage boundaries: a job row, its media, its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, get_args

from .errors import Stage
from .params import GenParams

__all__ = [
    "STAGES",
    "RowId",
    "Values",
    "ResultRow",
    "MEDIA_COLUMNS",
    "RESULT_COLUMNS",
    "KEPT_COLUMNS",
    "SLIM_DROPS",
    "TOTALS",
    "ByteCaps",
    "MediaRef",
    "MediaFile",
    "Part",
    "Message",
    "Job",
    "Scoring",
    "IMAGE_DIGEST",
    "MediaItem",
    "Media",
    "Logprob",
    "TokenLogprobs",
    "ChoiceScore",
    "ToolCall",
    "Generation",
    "GENERATED",
    "Result",
    "Finished",
]

MediaKind = Literal["image", "video", "audio"]
# A job row's values as its reader found them (JSON values, Parquet cells), by column: what
# parse checks and the output carries; its value types are only known where they are read.
Values = dict[str, Any]
# A results file's row read back (pyarrow's to_pylist): each column's value by its name.
ResultRow = dict[str, Any]
RowId = str | int  # a row's id: a string or an integer (a bool is neither); rows without one, their place

# Flat media columns and the kind each holds.
MEDIA_COLUMNS: dict[str, MediaKind] = {
    "image": "image",
    "images": "image",
    "video": "video",
    "videos": "video",
    "audio": "audio",
}

# The stages a row can fail in, in pipeline order (errors.Stage).
STAGES: tuple[Stage, ...] = get_args(Stage)


@dataclass(slots=True, frozen=True, kw_only=True)
class ByteCaps:
    """The most bytes one media item may have, by kind (reference.md's caps): a download, a
    data URL, a binary cell or a WebDataset member alike. A reader holds a job's caps, so a
    member over its cap is never read into memory."""

    image: int = 20 * 2**20
    video: int = 500 * 2**20
    audio: int = 100 * 2**20

    def of(self, kind: str) -> int:
        return {"image": self.image, "video": self.video, "audio": self.audio}[kind]

    @property
    def most(self) -> int:
        return max(self.image, self.video, self.audio)


@dataclass(slots=True, frozen=True)
class MediaRef:
    """One media reference as the row gave it: a URL, a local path or a data URL."""

    kind: MediaKind
    source: str | bytes  # bytes: the media themselves, from a binary column


@dataclass(slots=True, frozen=True, kw_only=True)
class MediaFile:
    """One media item as the run read it, kept with the row's result (`media_files`): export
    writes captions for these only, and a rerun sees a local file replaced under its name by
    its size and mtime, then its content."""

    kind: MediaKind
    ref: str | None  # the path or URL as the row gave it; None: bytes or a data URL
    size: int
    mtime_ns: int | None = None  # a local file's, when the run read it
    sha256: str | None = None  # of the content, where the run read it whole anyway (images, video)


@dataclass(slots=True, frozen=True, kw_only=True)
class Scoring:
    """What a row asks to be scored: each of `choices` (a guided_choice's, or choices_to_score)
    as the whole answer, normalized over them; `text` (score_text) as the answer."""

    choices: tuple[str, ...] = ()
    text: str | None = None
    asked: bool = True  # the row asked for scores (False: a guided_choice's, scored where a lane can)


class Part(TypedDict, total=False):
    """One part of a turn's content: `{"type": "text", "text": …}`, or a media part `{"type":
    kind, "media": i}` pointing into the row's media."""

    type: str
    text: str
    media: int


class Message(TypedDict):
    """One turn of a row's chat, as parse makes it: a string, or parts in the template's order."""

    role: str
    content: str | list[Part]


@dataclass(slots=True, kw_only=True)
class Job:
    """A parsed row. `messages` hold text parts and `{"type": kind, "media": i}` parts that
    point into `media`, in the order the chat template must see them."""

    index: int
    id: RowId
    line: int | None = None
    raw: Values = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    media: list[MediaRef] = field(default_factory=list)
    params: GenParams = field(default_factory=GenParams)
    video_fps: float | None = None  # per-row overrides of the run's frame sampling
    video_max_frames: int | None = None
    digest: str | None = None  # fingerprint of the input row (RawRow.digest)
    error: str | None = None
    unused_media: tuple[str, ...] = ()  # a row without media: its columns that look like media
    near_misses: tuple[str, ...] = ()  # its fields one slip from a field batchgen reads (`max_token`)
    asked_model: str | None = None  # an OpenAI Batch line's body.model: not used, said once
    scoring: Scoring | None = None  # answers to score as the assistant's reply, without generating them
    adapter: str | None = None  # the row's adapter, by its name in the run's set (BASE_ADAPTER: none)
    model: str | None = None  # the row's model, by its name in the run's set (--models); None: --model

    @property
    def where(self) -> str:
        """How error messages name this row."""
        at = f"line {self.line}" if self.line is not None else f"row {self.index}"
        return f"{at} (id {self.id!r:.80})"


# PIL's Image.info key under which a decoded image carries the digest of what it was decoded
# from: the image processor's memo (generate/load/loading.py) keys on it, never on the object.
IMAGE_DIGEST = "batchgen.digest"


@dataclass(slots=True, frozen=True)
class MediaItem:
    """One decoded media item of a row: its kind, what the engine takes (a PIL image, (T, H,
    W, 3) uint8 frames, an audio file's path) and its content digest (a video's: its content
    and frame sampling; prefix and vision-feature reuse key on it)."""

    kind: MediaKind
    payload: Any
    digest: str


@dataclass(slots=True)
class Media:
    """A row's decoded media, one record an item, in the order of the row's parts."""

    items: list[MediaItem] = field(default_factory=list)

    def of(self, kind: MediaKind) -> list[Any]:
        return [m.payload for m in self.items if m.kind == kind]

    def digests(self, kind: MediaKind) -> list[str]:
        return [m.digest for m in self.items if m.kind == kind]

    @property
    def images(self) -> list[Any]:
        return self.of("image")

    @property
    def videos(self) -> list[Any]:
        return self.of("video")

    @property
    def audio(self) -> list[str]:
        return self.of("audio")

    def __bool__(self) -> bool:
        return bool(self.items)


class Logprob(TypedDict):
    """A token and its log-probability (a generated token's, or one of its alternatives)."""

    token: str
    id: int
    logprob: float


class TokenLogprobs(Logprob, total=False):
    """A generated token's entry in a row's `logprobs`: its k likeliest alternatives, and the
    part of a thinking model's output it is in."""

    top_logprobs: list[Logprob]
    part: str  # reasoning or answer


class ChoiceScore(TypedDict, total=False):
    """One scored answer of a row: its total log-probability, its probability normalized over
    the row's choices, its tokens (the end-of-turn one included)."""

    choice: str
    logprob: float
    prob: float
    tokens: int


class ToolFunction(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI's API gives it


class ToolCall(TypedDict):
    """A call the answer made, as OpenAI's `message.tool_calls[]`."""

    id: str
    type: str
    function: ToolFunction


@dataclass(slots=True, kw_only=True)
class Generation:
    """What an engine returned for one row."""

    text: str  # the answer: a thinking model's reasoning apart, in `reasoning`
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int  # reasoning and answer
    cached_tokens: int = 0
    mtp_drafts: int = 0
    mtp_accepted: int = 0
    capped: bool = False  # max_tokens was lowered to what the model's context leaves
    logprobs: list[TokenLogprobs] | None = None  # with logprobs: each generated token's
    choice_scores: list[ChoiceScore] | None = None
    score_logprob: float | None = None  # score_text: its total log-probability as the answer
    score_mean: float | None = None  # ... per token
    score_tokens: int | None = None  # ... its tokens (the end-of-turn one included)
    reasoning: str | None = None  # a thinking model's reasoning block, its markers out; None: none
    reasoning_tokens: int = 0  # ... its tokens (markers not counted), part of completion_tokens
    tool_calls: list[ToolCall] | None = None  # a row with tools: the calls its answer made


# Counts an engine reports per row (Generation), kept per row (Result) and totalled per run (RunSummary).
TOTALS = (
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "mtp_drafts",
    "mtp_accepted",
)
# A row's Generation as the output's columns: its fields by their names, its text as the row's
# `generated_text`; whether max_tokens was lowered (`capped`) is counted per run, not kept.
GENERATED = {"text": "generated_text", **{f: f for f in Generation.__slots__ if f not in ("text", "capped")}}


@dataclass(slots=True, kw_only=True)
class Result:
    """One output row's columns of ours (the input columns travel beside it): what generation
    made of the row (`generation`, None for a row that failed before it) and how the row went."""

    id: RowId
    status: Literal["ok", "error"] = "ok"
    generation: Generation | None = None  # the text, finish reason, token counts, scores, calls
    error: str | None = None
    error_stage: Stage | None = None  # errors.Stage
    fetch_ms: float = 0.0
    decode_ms: float = 0.0
    frames_ms: float = 0.0
    generate_ms: float = 0.0
    model: str | None = None
    adapter: str | None = None  # the adapter folder the model ran with (--adapter, a row's `adapter`)
    adapter_sha256: str | None = None  # ... and its content (settings.adapter_digest): a rerun sees it change
    attempts: int = 1  # runs that generated this row, this one included (failed rows are retried)
    transient: bool = False  # the failure may not happen again (a server down, a timeout): retried
    choices: str | None = None  # n > 1: every completion, as JSON [{text, finish_reason, completion_tokens}]
    parsed: str | None = None  # a JSON-constrained row: its output, parsed and checked, as JSON text
    input_hash: str | None = None  # fingerprint of the input row: a rerun refuses changed rows
    media_files: list[dict[str, object]] | None = None  # MediaFile of each item read, as dicts
    # Not a column: the kinds of the row's answer fields (answers.answer_kinds) as JSON,
    # from which the writer makes the typed `answer.<field>` columns beside `parsed`.
    answer_kinds: str | None = None

    def columns(self) -> dict[str, Any]:
        """The row's value in each of our columns (RESULT_COLUMNS): a row without a generation
        has no text and counts nothing."""
        gen = self.generation
        made = {
            c: getattr(gen, f) if gen is not None else (0 if f in TOTALS else None)
            for f, c in GENERATED.items()
        }
        return {c: made[c] if c in made else getattr(self, c) for c in RESULT_COLUMNS}

    @classmethod
    def from_columns(cls, values: dict[str, Any]) -> Result:
        """A row back from its columns (and `answer_kinds`), as a Ray actor hands it over."""
        own = {k: v for k, v in values.items() if k in cls.__dataclass_fields__ and k != "generation"}
        if values.get("finish_reason") is None:  # no generation: the row failed before it
            return cls(**own)
        made = {f: values[c] for f, c in GENERATED.items() if c in values}
        return cls(**own, generation=Generation(**{**made, "text": made.get("text") or ""}))


# What the output holds of ours, in its order.
RESULT_COLUMNS = (
    "id",
    "status",
    "generated_text",
    "reasoning",
    "tool_calls",
    "finish_reason",
    "error",
    "error_stage",
    *TOTALS,
    "fetch_ms",
    "decode_ms",
    "frames_ms",
    "generate_ms",
    "model",
    "adapter",
    "adapter_sha256",
    "attempts",
    "transient",
    "choices",
    "parsed",
    "logprobs",
    "choice_scores",
    "score_logprob",
    "score_mean",
    "score_tokens",
    "input_hash",
    "media_files",
)
# Columns every output keeps, whatever it is told to leave out: what a rerun resumes from
# (which rows are done, whether they changed, which failures to try again) and why a row failed.
KEPT_COLUMNS = (
    "id",
    "status",
    "error",
    "error_stage",
    "input_hash",
    "media_files",
    "adapter",
    "adapter_sha256",
    "attempts",
    "transient",
)
# ... and those the `slim` output leaves out: how a row was made rather than what it says.
SLIM_DROPS = (
    "finish_reason",
    *TOTALS,
    "fetch_ms",
    "decode_ms",
    "frames_ms",
    "generate_ms",
    "model",
)


@dataclass(slots=True, kw_only=True)
class Finished:
    """A row done, as an executor hands it to the writer: the input values carried to the
    output, how messages name the row, and its result."""

    values: Values
    where: str
    result: Result

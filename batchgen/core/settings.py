"""A run's settings as frozen records; execution/config builds them from presets, files and flags."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeGuard

from .budget import budget_spec
from .errors import ConfigError
from .keep import KeepIf
from .params import GenParams
from .records import KEPT_COLUMNS, RESULT_COLUMNS, SLIM_DROPS, ByteCaps

__all__ = [
    "MediaConfig",
    "Columns",
    "RunConfig",
    "Stage",
    "stages_of",
    "GenerationSettings",
    "WorkSettings",
    "work_settings",
    "KV_BITS",
    "KV_GROUPS",
    "GEN_FIELDS",
    "Fingerprint",
    "FLAG_NAMES",
]

GEN_FIELDS = tuple(f.name for f in dataclasses.fields(GenParams))
# What decides an output's content, as JSON (output/resume.settings_of): kept with the output
# and compared by the next run.
Fingerprint = dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaConfig:
    """How media are fetched and bounded; each default carries its reason."""

    max_image_pixels: int = 64_000_000  # 8k×8k: past this it is a bomb, not a photo
    max_row_pixels: int = 100_000_000  # decoded pixels per row, images and frames (~300 MB RGB)
    frame_pixels: int | None = None  # frames are downscaled to this; None: the model's own, else 602,112
    window_media_bytes: int = 512 * 2**20  # decoded media held by rows waiting for generation
    image_bytes: int = ByteCaps().image  # caps from reference.md
    video_bytes: int = ByteCaps().video
    audio_bytes: int = ByteCaps().audio
    image_timeout: float = 30.0  # seconds for a whole download, not per read
    video_timeout: float = 120.0
    audio_timeout: float = 120.0
    retries: int = 3  # attempts per URL on connection errors, timeouts, 5xx and 429
    allow_private_urls: bool = False  # loopback/private targets: only for trusted job files
    media_root: str | None = None  # if set, local paths must lie inside it
    media_cache: str | None = None  # folder keeping downloads across runs
    fetch_workers: int = 16  # downloads in flight: I/O bound, cheap threads
    decode_workers: int = 2  # decodes at once: CPU bound, leave cores to generation
    video_fps: float = 2.0  # enough to follow motion without flooding the context
    video_min_frames: int = 4
    video_max_frames: int = 128

    def __post_init__(self) -> None:
        """Checked however it is made (build_config, or in Python)."""
        if not 1 <= self.video_min_frames <= self.video_max_frames or self.video_fps <= 0:
            raise ConfigError(
                "video settings need 0 < video_fps and 1 <= video_min_frames <= video_max_frames"
            )
        if min(self.retries, self.fetch_workers, self.decode_workers) < 1:
            raise ConfigError("retries, fetch_workers and decode_workers must be >= 1")
        if min(self.max_image_pixels, self.max_row_pixels, self.frame_pixels or 1) < 1:
            raise ConfigError("max_image_pixels, max_row_pixels and frame_pixels must be >= 1")

    @property
    def caps(self) -> ByteCaps:
        return ByteCaps(image=self.image_bytes, video=self.video_bytes, audio=self.audio_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Columns:
    """Which of a dataset's columns hold the row's id, prompt, system prompt and media, for
    files whose columns are not named as batchgen's are (img2dataset's `key` and `jpg`)."""

    id: str | None = None
    prompt: str | None = None
    system: str | None = None
    image: tuple[str, ...] = ()  # several columns: each row's images in this order
    score: str | None = None  # a text to score as the answer (score_text): a crawl's alt text
    video: tuple[str, ...] = ()
    model: str | None = None  # the field naming the row's model of the run's set (--models: `model`)

    def named(self) -> list[tuple[str, str]]:
        """(flag, column) for each mapped column."""
        pairs = [
            ("--id-column", self.id),
            ("--prompt-column", self.prompt),
            ("--system-column", self.system),
            ("--score-column", self.score),
        ]
        pairs += [("--image-column", c) for c in self.image] + [("--video-column", c) for c in self.video]
        return [(flag, c) for flag, c in pairs if c]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One stage of a staged job (a preset's `stages:`): its name (its columns' prefix in the
    output), the run settings it runs with (the job's, overlaid with its own; input and output
    are set when it runs) and the rule its rows must meet to go on (core/keep)."""

    name: str
    config: RunConfig
    keep_if: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Everything one run needs; `batchgen.run(config)` takes nothing else."""

    input: Path | str  # a job file, a folder or glob of shards, or a URI (s3://, gs://, hf://)
    output: Path | str  # a Parquet file or, with output_shards, a folder of shards; or a URI
    model: str
    text_model: str | None = None  # text-only rows; defaults to `model`
    adapter: str | None = None  # a LoRA/DoRA adapter folder (ADAPTER_FILES) applied to `model`
    adapters: tuple[tuple[str, str], ...] = ()  # (name, folder): adapters rows name in their `adapter`
    models: tuple[tuple[str, str], ...] = ()  # (name, path or id): models rows name in their `model`
    fuse_adapters: bool = False  # adapters fused into the weights as applied (mlx_lm fuse's rows)
    format: str | None = None  # jsonl | parquet | csv; None = from the extension
    prompt_template: str | None = None  # fills each row's prompt from its columns
    columns: Columns = field(default_factory=Columns)  # dataset columns taken as id, prompt, media
    keep_columns: tuple[str, ...] = ()  # carried to the output although binary (images as bytes)
    drop_columns: tuple[str, ...] = ()  # not carried to the output
    result_columns: Literal["all", "slim"] = "all"  # slim: our columns but how rows were made (SLIM_DROPS)
    drop_result_columns: tuple[str, ...] = ()  # more of our columns left out (never KEPT_COLUMNS)
    openai_output: Path | None = None  # also write an OpenAI Batch output file here
    defaults: GenParams = field(default_factory=GenParams)
    media: MediaConfig = field(default_factory=MediaConfig)
    limit: int | None = None
    shard: tuple[int, int] | None = None  # (i, n): only the rows of shard i of n
    overwrite: bool = False
    fail_fast: bool = False
    max_attempts: int = 3  # runs a transiently failed row gets (a server down at 3 a.m. is back at 4)
    retry_failed: bool = False  # a rerun tries every failed row again, transient or not
    redo_repetition: float | None = None  # a rerun generates the loop stop's rows again with this penalty
    changed: Literal["refuse", "redo", "keep"] = "refuse"  # rows changed under a finished id (refuse: exit 2)
    draft_model: str | None = None  # speculative decoding: a text draft model or an mlx-vlm drafter
    num_draft_tokens: int = 3  # text drafts per round
    draft_kind: str | None = None  # mtp | dflash | eagle3 (vision drafters); None = from the checkpoint
    draft_block_size: int | None = None  # vision drafters; None = the drafter's own
    executor: Literal["local", "ray"] = "local"  # where rows run (the --engine flag): here, or Ray actors
    ray_address: str | None = None  # join this Ray cluster; None = start a local instance
    workers: int = 1  # Ray actors, one model load each
    cache: bool = True  # reuse prompt-prefix KV state across rows (--no-cache to compare)
    cache_entries: int = 50  # prefix snapshots kept (LRU)
    cache_bytes: int = 2 * 2**30  # ... and their memory
    batch_size: int = 32  # rows decoded together at most; 1 turns batching off
    memory_budget: str | None = "auto"  # auto | SIZE | PCT | off: rows join a batch while it fits
    kv_bits: int | None = None  # a quantized KV cache (KV_BITS): rows then run one at a time
    kv_group_size: int = 64  # ... quantized in groups of this many values (KV_GROUPS)
    quantized_kv_start: int = 0  # ... from this many tokens on (mlx-lm's own default is 5000)
    continuous: bool = True  # a finished row's slot goes to a waiting row; False: static batches
    window: int = 256  # rows looked ahead (media resolved, rows grouped by shared images); bounds memory
    plan_horizon: int = 512  # MiB of rows held back to meet the rest of their group (input/plan); 0: off
    plan_aside: bool = True  # the next window's rows planned on a thread while this one decodes
    local_paths: bool = True  # rows may name files of this machine; off: a server's clients' jobs
    stages: tuple[Stage, ...] = ()  # a staged job: each stage's rows feed the next (execution/stages)
    paths_from: str | None = None  # where rows' relative paths start; None: the job file's folder
    output_shards: bool = False  # -o DIR/: a folder of Parquet shards, never one table in memory
    shard_rows: int = 100_000  # rows per shard: a few hundred MB at most for captioning rows
    flush_rows: int = 64  # rows per part file: a kill loses at most this many
    flush_seconds: float = 10.0  # ... or this much work, whichever comes first
    row_timeout: float | None = None  # seconds a row may generate (from its prefill); None = no limit
    progress_seconds: float = 30.0  # without a terminal: a progress line this often (cron logs)
    quiet: bool = False
    time_limit: float | None = None  # seconds (--time-limit 55m): no batch begun that would end past it
    fail_on: Literal["any", "new", "none"] = "any"  # the failed rows that make exit 1 (new: this run's)
    require_complete: bool = False  # an incomplete run (--limit, --time-limit) exits 4
    errors_file: Path | str | None = None  # the failed rows, a JSON line each; None: beside the output

    def __post_init__(self) -> None:
        """Checked however it is made (build_config, or in Python): each value in its range."""
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                flag = FLAG_NAMES.get(name, name).replace("_", "-")
                raise ConfigError(f"--{flag} {getattr(self, name)!r:.40}: expected {_either(allowed)}")
        redo = self.redo_repetition
        penalty = _number(redo, (int, float)) and 1 < redo <= 3
        if redo is not None and (self.executor == "ray" or not penalty):
            raise ConfigError(
                f"--redo-repetition {str(redo)[:40]}: a repetition penalty above 1 and at most 3 (e.g. 1.3; "
                "more turns the redone answer to noise), with the local engine"
            )
        for key in ("batch_size", "window", "cache_entries", "workers", "max_attempts"):
            if not _number(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1")
        budget_spec(self.memory_budget)  # a budget that cannot be read stops the run here
        if self.kv_bits is not None and (type(self.kv_bits) is not int or self.kv_bits not in KV_BITS):
            raise ConfigError(f"--kv-bits {self.kv_bits!r}: expected one of {', '.join(map(str, KV_BITS))}")
        if type(self.kv_group_size) is not int or self.kv_group_size not in KV_GROUPS:
            raise ConfigError(f"--kv-group-size {self.kv_group_size!r}: expected 32, 64 or 128")
        if type(self.quantized_kv_start) is not int or self.quantized_kv_start < 0:
            raise ConfigError(
                f"--quantized-kv-start {self.quantized_kv_start!r}: expected a token count >= 0"
            )
        if self.row_timeout is not None and not (
            _number(self.row_timeout, (int, float)) and self.row_timeout > 0
        ):
            raise ConfigError("--row-timeout must be > 0 seconds")
        if self.time_limit is not None and not (
            _number(self.time_limit, (int, float)) and self.time_limit > 0
        ):
            raise ConfigError(f"--time-limit {str(self.time_limit)[:40]!r}: must be more than 0 seconds")
        if self.limit is not None and not (_number(self.limit, int) and self.limit >= 0):
            raise ConfigError("--limit must be >= 0")
        if not _number(self.plan_horizon, int) or self.plan_horizon < 0:
            raise ConfigError("--plan-horizon must be >= 0 (MiB; 0 runs the rows in job order)")
        for name in self.drop_result_columns:
            if name not in RESULT_COLUMNS or name in KEPT_COLUMNS:
                why = "every output keeps it" if name in KEPT_COLUMNS else "not one of batchgen's columns"
                droppable = ", ".join(c for c in RESULT_COLUMNS if c not in KEPT_COLUMNS)
                raise ConfigError(f"--drop-result-columns {name!r:.60}: {why} (these can go: {droppable})")

    @property
    def model_paths(self) -> tuple[str, ...]:
        """Each model the run loads for a row's generation: --model's first, then --models'."""
        return tuple(dict.fromkeys([self.model, *(path for _, path in self.models)]))

    def per_model(self) -> list[RunConfig]:
        """The run as one config per model it loads (model_paths' order), each with that model."""
        return [dataclasses.replace(self, model=path) for path in self.model_paths]

    @property
    def model_name(self) -> str:
        """How rows that name no model know theirs: its name in --models, else its path."""
        return next((name for name, path in self.models if path == self.model), self.model)

    def model_for(self, name: str | None) -> str:
        """The model of a row naming `name` (--model's for none; one not in the set fails there)."""
        return dict(self.models).get(name, self.model) if name is not None else self.model

    @property
    def left_out(self) -> frozenset[str]:
        """Our columns the output does not hold (the parts, which a kill leaves, hold them all)."""
        return frozenset(self.drop_result_columns) | frozenset(
            SLIM_DROPS if self.result_columns == "slim" else ()
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationSettings:
    """What generation needs from a run: the models, the drafter, reuse, the row deadline, the
    batch width and how batches fill."""

    model: str
    text_model: str | None
    adapter: str | None
    adapters: tuple[tuple[str, str], ...]
    models: tuple[tuple[str, str], ...]
    fuse_adapters: bool
    draft_model: str | None
    num_draft_tokens: int
    draft_kind: str | None
    draft_block_size: int | None
    cache: bool
    cache_entries: int
    cache_bytes: int
    row_timeout: float | None
    memory_budget: str | None
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    batch_size: int
    continuous: bool
    # Where a row's adapter folder starts (the job's folder; None: a remote job, whose rows
    # name --adapters only) and the media root it must lie in, as a media path must.
    job_dir: Path | None = None
    media_root: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkSettings:
    """What an executor (here, or a Ray actor) needs: no outputs, no cluster address."""

    generation: GenerationSettings
    media: MediaConfig
    defaults: GenParams
    prompt_template: str | None
    columns: Columns
    window: int
    base_dir: Path | None  # where the job's relative media paths start; None: no local paths
    plan_aside: bool = True  # the next window's rows planned beside generation (execution/planner)


def work_settings(config: RunConfig, base: str | None) -> WorkSettings:
    """What executors need; `base` is the job's Source.base."""
    job_dir = Path(base) if base is not None and config.local_paths else None
    generation = GenerationSettings(
        **_taken(GenerationSettings, config), job_dir=job_dir, media_root=config.media.media_root
    )
    return WorkSettings(**_taken(WorkSettings, config), generation=generation, base_dir=job_dir)


def _taken(share: type, config: RunConfig) -> dict[str, Any]:
    """A share's fields the run's config holds under the same names, as it holds them."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(share) if hasattr(config, f.name)}


# How rows name an adapter or model of the run's set (an OpenAI body's model: org/name:tag).
SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
BASE_ADAPTER = "base"  # a row's `adapter` for the model as it is, beside a run's --adapter


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUPS = (32, 64, 128)
# Settings whose flag (and preset key) is named otherwise than their field.
FLAG_NAMES = {"executor": "engine"}
# The settings that name one of a few ways, and those ways.
_CHOICES = {
    "changed": ("refuse", "redo", "keep"),
    "executor": ("local", "ray"),
    "fail_on": ("any", "new", "none"),
    "result_columns": ("all", "slim"),
}


def _number(value: object, kind: type | tuple[type, ...]) -> TypeGuard[float]:
    """A number of that kind (a bool is none, though Python counts it an int)."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _either(allowed: tuple[str, ...]) -> str:
    return f"{', '.join(allowed[:-1])} or {allowed[-1]}"


_STAGE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_RESERVED_STAGES = {"id", "input", "answer", "dropped_at", "stage", "true", "false", "null"}
MAX_STAGES = 16


def stages_of(raw: object, stage_config: Callable[[dict[str, Any]], RunConfig]) -> tuple[Stage, ...]:
    """A preset's `stages:`, each checked as a run's settings are (a stage's error names it),
    its keep_if's syntax too (the names it reads are checked against the job's columns when
    the run starts)."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_STAGES:
        raise ConfigError(f"stages: a list of 1 to {MAX_STAGES} stages, each a mapping with a name")
    stages: list[Stage] = []
    for number, item in enumerate(raw, 1):
        if not isinstance(item, dict):
            raise ConfigError(f"stages: stage {number} is not a mapping of settings")
        own = dict(item)
        name = own.pop("name", None)
        if not isinstance(name, str) or not _STAGE_NAME.fullmatch(name) or name in _RESERVED_STAGES:
            raise ConfigError(
                f"stages: stage {number}'s name {name!r:.40} must be like caption or score_2 "
                "(lowercase letters, digits, _; not id, input or answer)"
            )
        if any(s.name == name for s in stages):
            raise ConfigError(f"stages: two stages are named {name!r}")
        keep_if = own.pop("keep_if", None)
        if keep_if is not None:
            KeepIf.parse(keep_if, None, where=f"stage {name}: keep_if")
        if "stages" in own:
            raise ConfigError(f"stage {name}: a stage holds no stages")
        try:
            config = stage_config(own)
        except ConfigError as e:
            raise ConfigError(f"stage {name}: {e}") from None
        stages.append(Stage(name=name, config=config, keep_if=keep_if))
    return tuple(stages)

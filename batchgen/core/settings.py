"""Run configuration: one frozen dataclass, built once from a YAML preset and CLI flags."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .budget import budget_spec, parse_duration
from .constraints import CONSTRAINT_FIELDS, constraint_of
from .errors import ConfigError, one_line
from .params import check_params
from .records import KEPT_COLUMNS, RESULT_COLUMNS, SLIM_DROPS, ByteCaps, GenParams
from .uris import checked_location, is_uri

__all__ = [
    "MediaConfig",
    "Columns",
    "RunConfig",
    "EngineSettings",
    "WorkSettings",
    "work_settings",
    "find_preset",
    "load_preset",
    "read_settings_file",
    "read_json_settings",
    "build_config",
    "build_columns",
    "KV_BITS",
    "KV_GROUPS",
    "GEN_FIELDS",
]

PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # a checkout's presets
GEN_FIELDS = tuple(f.name for f in dataclasses.fields(GenParams))


@dataclass(frozen=True, slots=True)
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

    @property
    def caps(self) -> ByteCaps:
        return ByteCaps(self.image_bytes, self.video_bytes, self.audio_bytes)


@dataclass(frozen=True, slots=True)
class Columns:
    """Which of a dataset's columns hold the row's id, prompt, system prompt and media, for
    files whose columns are not named as batchgen's are (img2dataset's `key` and `jpg`)."""

    id: str | None = None
    prompt: str | None = None
    system: str | None = None
    image: tuple[str, ...] = ()  # several columns: each row's images in this order
    score: str | None = None  # a text to score as the answer (score_text): a crawl's alt text
    video: tuple[str, ...] = ()

    def named(self) -> list[tuple[str, str]]:
        """(flag, column) for each mapped column."""
        pairs = [("--id-column", self.id), ("--prompt-column", self.prompt), ("--system-column", self.system),
                 ("--score-column", self.score)]  # fmt: skip
        pairs += [("--image-column", c) for c in self.image] + [("--video-column", c) for c in self.video]
        return [(flag, c) for flag, c in pairs if c]


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything one run needs; `batchgen.run(config)` takes nothing else."""

    input: Path | str  # a job file, a folder or glob of shards, or a URI (s3://, gs://, hf://)
    output: Path | str  # a Parquet file or, with output_shards, a folder of shards; or a URI
    model: str
    text_model: str | None = None  # text-only rows; defaults to `model`
    format: str | None = None  # jsonl | parquet | csv; None = from the extension
    prompt_template: str | None = None  # fills each row's prompt from its columns
    columns: Columns = field(default_factory=Columns)  # dataset columns taken as id, prompt, media
    keep_columns: tuple[str, ...] = ()  # carried to the output although binary (images as bytes)
    drop_columns: tuple[str, ...] = ()  # not carried to the output
    result_columns: str = "all"  # all | slim: our columns but how each row was made (SLIM_DROPS)
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
    changed: str = "refuse"  # rows changed under a finished id: refuse (exit 2), redo them, or keep
    draft_model: str | None = None  # speculative decoding: a text draft model or an mlx-vlm drafter
    num_draft_tokens: int = 3  # text drafts per round
    draft_kind: str | None = None  # mtp | dflash | eagle3 (vision drafters); None = from the checkpoint
    draft_block_size: int | None = None  # vision drafters; None = the drafter's own
    engine: str = "local"  # local | ray
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
    output_shards: bool = False  # -o DIR/: a folder of Parquet shards, never one table in memory
    shard_rows: int = 100_000  # rows per shard: a few hundred MB at most for captioning rows
    flush_rows: int = 64  # rows per part file: a kill loses at most this many
    flush_seconds: float = 10.0  # ... or this much work, whichever comes first
    row_timeout: float | None = None  # seconds a row may generate (from its prefill); None = no limit
    progress_seconds: float = 30.0  # without a terminal: a progress line this often (cron logs)
    quiet: bool = False
    time_limit: float | None = None  # seconds (--time-limit 55m): no batch begun that would end past it
    fail_on: str = "any"  # any | new (failed in this run) | none: the failed rows that make the exit code 1
    require_complete: bool = False  # an incomplete run (--limit, --time-limit) exits 4
    errors_file: Path | str | None = None  # the failed rows, a JSON line each; None: beside the output

    @property
    def left_out(self) -> frozenset[str]:
        """Our columns the output does not hold (the parts, which a kill leaves, hold them all)."""
        return frozenset(self.drop_result_columns) | frozenset(
            SLIM_DROPS if self.result_columns == "slim" else ()
        )


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the engines need from a run: the models, the drafter, reuse, the row deadline."""

    model: str
    text_model: str | None
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


@dataclass(frozen=True, slots=True)
class WorkSettings:
    """What an executor (here, or a Ray actor) needs: no outputs, no cluster address."""

    engine: EngineSettings
    media: MediaConfig
    defaults: GenParams
    prompt_template: str | None
    columns: Columns
    window: int
    batch_size: int
    continuous: bool
    base_dir: Path | None  # where the job's relative media paths start; None: a remote job


def work_settings(config: RunConfig, base: str | None) -> WorkSettings:
    """What executors need; `base` is the job's Source.base."""
    engine = EngineSettings(**{f.name: getattr(config, f.name) for f in dataclasses.fields(EngineSettings)})
    return WorkSettings(
        engine, config.media, config.defaults, config.prompt_template, config.columns, config.window,
        config.batch_size, config.continuous, Path(base) if base is not None else None,
    )  # fmt: skip


def find_preset(name_or_path: str | None) -> Path | None:
    """A config path, or a preset name looked up in ./configs then the project's configs/."""
    if name_or_path is None:
        name_or_path = "default"
        required = False
    else:
        required = True
    candidates = [Path(name_or_path)]
    if not name_or_path.endswith((".yaml", ".yml")):
        name = f"{name_or_path}.yaml"
        candidates += [Path("configs") / name, *_packaged(name), PROJECT_CONFIGS / name]
    for path in candidates:
        if path.is_file():
            return path
        if path.exists() and not path.is_dir():
            raise ConfigError(f"config {path}: not a regular file")
    if required:
        raise ConfigError(f"config {name_or_path!r} not found (looked in {', '.join(map(str, candidates))})")
    return None


def _packaged(name: str) -> list[Path]:
    """The preset as installed with the package (batchgen.configs, built from configs/)."""
    from importlib import resources

    try:
        return [Path(str(resources.files("batchgen.configs") / name))]
    except (ModuleNotFoundError, TypeError):  # a source tree run without installing
        return []


SETTINGS_FILE_BYTES = 16 * 2**20  # presets and schemas are kilobytes: /dev/zero is not one


def read_settings_file(path: Path, what: str) -> str:
    """A preset's or a schema's text: a regular file of bounded size, opened without blocking,
    so that a FIFO, a device or an endless file is a message, never a run that waits."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"{what} {path}: not a regular file")
            data = f.read(SETTINGS_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if len(data) > SETTINGS_FILE_BYTES:
        raise ConfigError(f"{what} {path}: over {SETTINGS_FILE_BYTES // 2**20} MiB")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path}: not UTF-8 text") from e


def read_json_settings(path: Path, what: str) -> Any:
    try:
        return json.loads(read_settings_file(path, what))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path}: not a JSON file ({e})") from e
    except RecursionError as e:
        raise ConfigError(f"{what} {path}: nested too deep to read") from e


def load_preset(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(read_settings_file(path, "config")) or {}
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"cannot read config {path}: {one_line(str(e))}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping at the top level")
    # Model paths in a preset are relative to the preset, so it works from any folder. The
    # default preset's sample models are in a checkout only: installed from a wheel, it names none.
    for key in ("model", "text_model"):
        value = data.get(key)
        if isinstance(value, str) and value.startswith("."):
            local = (path.parent / value).resolve()
            if path.name == "default.yaml" and not local.exists():
                data.pop(key)
            else:
                data[key] = str(local)  # absolute: the output's `model` reads the same from any folder
    return data


def _gen_params(values: dict[str, Any]) -> GenParams:
    unknown = set(values) - set(GEN_FIELDS)
    if unknown:
        raise ConfigError(f"unknown generation setting(s): {', '.join(sorted(unknown))}")
    problems, params = check_params(values, GenParams())
    if problems:
        raise ConfigError("; ".join(f"{k}: {msg}" for k, msg in problems))
    return params


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUPS = (32, 64, 128)
_LISTS = ("keep_columns", "drop_columns", "drop_result_columns")  # a preset may give one name as text


def build_config(
    input: str | Path,
    output: str | Path,
    preset: str | None = None,
    generation: dict[str, Any] | None = None,
    media: dict[str, Any] | None = None,
    columns: dict[str, Any] | None = None,
    **overrides: Any,
) -> RunConfig:
    """Merge preset < flags (None or empty means 'not given') into a validated RunConfig.

    What the CLI builds a run from, and the way to build one in Python: `preset` a name or
    YAML path (None: configs/default.yaml where it can be found); `generation` GenParams
    fields (max_tokens, temperature, json_schema, …); `media` MediaConfig fields; `columns`
    the column mapping (id, prompt, image, …); any other RunConfig field by keyword (model,
    batch_size, time_limit="55m", fail_on, …). A bad value raises ConfigError naming it."""
    input, output = checked_location(str(input), "job"), checked_location(str(output), "-o")
    data = load_preset(find_preset(preset))
    gen = dict(data.pop("generation", None) or {})
    gen.update({k: v for k, v in (generation or {}).items() if v is not None})
    med = dict(data.pop("media", None) or {})
    med.update({k: v for k, v in (media or {}).items() if v is not None})
    mapping = build_columns(data.pop("columns", None) or {}, columns or {})
    constraint = _constraint(gen)
    for key in _LISTS:
        if isinstance(data.get(key), str):
            data[key] = (data[key],)
        if overrides.get(key) == ():
            overrides[key] = None
    if overrides.get("model") is not None and overrides.get("text_model") is None:
        data.pop("text_model", None)  # --model alone means that model for every row
    data.update({k: v for k, v in overrides.items() if v is not None})
    if not data.get("model"):
        raise ConfigError(
            "no model: pass --model PATH_OR_ID (e.g. mlx-community/Qwen2.5-VL-3B-Instruct-4bit) or a preset, "
            "--config qwen2.5-vl-captioning, qwen3-vl-video or olmocr-documents (the bundled sample models "
            "come with a checkout of the repository, not with the package)"
        )
    allowed = {f.name for f in dataclasses.fields(RunConfig)} - {"input", "output", "defaults", "media"}
    allowed.discard("columns")
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(sorted(unknown))}")
    limits = _media_config(med)
    _check_run_settings(data)
    if str(output).endswith("/") or (not is_uri(str(output)) and Path(output).is_dir()):
        data["output_shards"] = True  # -o DIR/ (or a folder that exists): shards
    if data.get("output_shards") and data.get("openai_output") is not None:
        raise ConfigError("--output-format openai/both writes one file: give -o a file name, not a folder")
    if mapping.prompt and data.get("prompt_template"):
        raise ConfigError("give --prompt-column or --prompt-template, not both")
    _check_result_columns(data)
    data = {k: tuple(v) if k in _LISTS else v for k, v in data.items()}
    return RunConfig(
        input=str(input) if is_uri(str(input)) else Path(input),
        output=str(output).rstrip("/") if is_uri(str(output)) else Path(output),
        defaults=dataclasses.replace(_gen_params(gen), constraint=constraint),
        media=limits,
        columns=mapping,
        **data,
    )


def _media_config(med: dict[str, Any]) -> MediaConfig:
    """The media settings, checked."""
    media_fields = {f.name for f in dataclasses.fields(MediaConfig)}
    if set(med) - media_fields:
        raise ConfigError(f"unknown media setting(s): {', '.join(sorted(set(med) - media_fields))}")
    limits = MediaConfig(**med)
    if not 1 <= limits.video_min_frames <= limits.video_max_frames or limits.video_fps <= 0:
        raise ConfigError("video settings need 0 < video_fps and 1 <= video_min_frames <= video_max_frames")
    if min(limits.retries, limits.fetch_workers, limits.decode_workers) < 1:
        raise ConfigError("retries, fetch_workers and decode_workers must be >= 1")
    if min(limits.max_image_pixels, limits.max_row_pixels, limits.frame_pixels or 1) < 1:
        raise ConfigError("max_image_pixels, max_row_pixels and frame_pixels must be >= 1")
    return limits


def _check_result_columns(data: dict[str, Any]) -> None:
    """--result-columns and --drop-result-columns name what batchgen writes, and never what a rerun needs."""
    if data.get("result_columns", "all") not in ("all", "slim"):
        raise ConfigError(f"--result-columns {data['result_columns']!r}: expected all or slim")
    for name in data.get("drop_result_columns") or ():
        if name not in RESULT_COLUMNS or name in KEPT_COLUMNS:
            why = "every output keeps it" if name in KEPT_COLUMNS else "not one of batchgen's columns"
            droppable = ", ".join(c for c in RESULT_COLUMNS if c not in KEPT_COLUMNS)
            raise ConfigError(f"--drop-result-columns {name!r:.60}: {why} (these can go: {droppable})")


def _check_run_settings(data: dict[str, Any]) -> None:
    """The run-wide settings' values, checked (and read: a shard, a duration) in place."""
    if data.get("changed", "refuse") not in ("refuse", "redo", "keep"):
        raise ConfigError(f"--changed {data['changed']!r}: expected refuse, redo or keep")
    if data.get("engine", "local") not in ("local", "ray"):
        raise ConfigError(f"--engine {data['engine']!r}: expected local or ray")
    redo = data.get("redo_repetition")
    if redo is not None and (data.get("engine") == "ray" or not float(redo) > 0):
        raise ConfigError("--redo-repetition: a repetition penalty > 0 (e.g. 1.3), with the local engine")
    for key in ("batch_size", "window", "cache_entries", "workers", "max_attempts"):
        if data.get(key) is not None and int(data[key]) < 1:
            raise ConfigError(f"{key} must be >= 1")
    shard = data.get("shard")
    if shard is not None:
        if isinstance(shard, str):
            try:
                shard = tuple(int(x) for x in shard.split("/"))
            except ValueError:
                shard = ()
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ConfigError(f"--shard {data['shard']!r}: expected i/N with 0 <= i < N, e.g. 0/4")
        data["shard"] = tuple(shard)
    budget_spec(data.get("memory_budget", "auto"))  # a budget that cannot be read stops the run here
    bits, group, start = (data.get(k, d) for k, d in (("kv_bits", None), ("kv_group_size", 64),
                                                      ("quantized_kv_start", 0)))  # fmt: skip
    if bits is not None and (type(bits) is not int or bits not in KV_BITS):
        raise ConfigError(f"--kv-bits {bits!r}: expected one of {', '.join(map(str, KV_BITS))}")
    if type(group) is not int or group not in KV_GROUPS:
        raise ConfigError(f"--kv-group-size {group!r}: expected 32, 64 or 128")
    if type(start) is not int or start < 0:
        raise ConfigError(f"--quantized-kv-start {start!r}: expected a token count >= 0")
    if data.get("time_limit") is not None:
        data["time_limit"] = parse_duration(data["time_limit"])
    if data.get("fail_on", "any") not in ("any", "new", "none"):
        raise ConfigError(f"--fail-on {data['fail_on']!r:.40}: expected any, new or none")
    if data.get("errors_file") is not None and not is_uri(str(data["errors_file"])):
        data["errors_file"] = Path(data["errors_file"])
    if data.get("row_timeout") is not None and not float(data["row_timeout"]) > 0:
        raise ConfigError("--row-timeout must be > 0 seconds")
    if data.get("limit") is not None and int(data["limit"]) < 0:
        raise ConfigError("--limit must be >= 0")
    if data.get("plan_horizon") is not None and int(data["plan_horizon"]) < 0:
        raise ConfigError("--plan-horizon must be >= 0 (MiB; 0 runs the rows in job order)")


def _constraint(gen: dict[str, Any]) -> Any:
    """The run's output constraint (--json-schema FILE, --guided-choice, --guided-regex, or the
    same keys under a preset's `generation:`), taken out of `gen`."""
    given = {k: gen.pop(k) for k in CONSTRAINT_FIELDS if gen.get(k) not in (None, (), [])}
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}
    problems: list[tuple[str, str]] = []
    constraint = constraint_of(given, problems)
    if problems:
        raise ConfigError("; ".join(f"{k}: {msg}" for k, msg in problems))
    return constraint


def build_columns(preset: Any, flags: dict[str, Any]) -> Columns:
    """The column mapping: the preset's `columns:` overlaid with the flags (empty = not given)."""
    if not isinstance(preset, dict):
        raise ConfigError("columns: expected a mapping such as {id: key, image: jpg}")
    values = {**preset, **{k: v for k, v in flags.items() if v not in (None, ())}}
    unknown = set(values) - {f.name for f in dataclasses.fields(Columns)}
    if unknown:
        raise ConfigError(
            f"unknown columns setting(s): {', '.join(sorted(unknown))} "
            "(id, prompt, system, image, video, score)"
        )
    for key in ("image", "video"):
        if isinstance(values.get(key), str):
            values[key] = (values[key],)
        values[key] = tuple(values.get(key) or ())
    for key, value in values.items():
        names = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(n, str) and n for n in names if n is not None):
            raise ConfigError(f"columns: {key}: expected a column name, got {value!r:.60}")
    return Columns(**values)

"""A run's settings as a person gives them (preset, files, flags), merged and checked into RunConfig.

A preset is found in ./configs, among the installed presets or in a checkout's configs/. The CLI
and `batchgen.build_config` both build through here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..core.budget import parse_duration
from ..core.constraints import CONSTRAINT_FIELDS, constraint_of
from ..core.errors import ConfigError, one_line
from ..core.files import adapter_config
from ..core.params import Constraint, GenParams, check_params
from ..core.settings import (
    BASE_ADAPTER,
    FLAG_NAMES,
    GEN_FIELDS,
    SET_NAME,
    Columns,
    MediaConfig,
    RunConfig,
    stages_of,
)
from ..core.uris import checked_location, is_uri

__all__ = [
    "find_preset",
    "load_preset",
    "read_settings_file",
    "read_json_settings",
    "build_config",
    "build_columns",
]

PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # a checkout's presets


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
    for key in ("adapters", "models"):  # each folder relative to the preset too
        if isinstance(data.get(key), dict):
            relative = {k: v for k, v in data[key].items() if isinstance(v, str) and v.startswith(".")}
            data[key] |= {k: str((path.parent / v).resolve()) for k, v in relative.items()}
    for key in ("model", "text_model", "adapter"):
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
    batch_size, time_limit="55m", fail_on, …; `engine`, as the flag says, for `executor`). A bad
    value raises ConfigError naming it."""
    input, output = checked_location(str(input), "job"), checked_location(str(output), "-o")
    given = dict(overrides)  # as the caller gave them: each stage's settings overlay these
    data = load_preset(find_preset(preset))
    preset_stages = data.pop("stages", None)
    stages = overrides.pop("stages", None)  # (): a stage's own settings, which hold no stages
    stages = preset_stages if stages is None else stages
    gen = dict(data.pop("generation", None) or {})
    gen.update({k: v for k, v in (generation or {}).items() if v is not None})
    med = dict(data.pop("media", None) or {})
    med.update({k: v for k, v in (media or {}).items() if v is not None})
    mapping = build_columns(data.pop("columns", None) or {}, columns or {})
    constraint = _constraint(gen)
    _overlaid(data, overrides)
    if data.get("models"):
        _check_models(data)
        mapping = dataclasses.replace(mapping, model="model")  # rows name theirs in this field
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
    _check_outputs(data, output, mapping)
    data = {k: tuple(v) if k in _LISTS else v for k, v in data.items()}
    config = RunConfig(
        input=str(input) if is_uri(str(input)) else Path(input),
        output=str(output).rstrip("/") if is_uri(str(output)) else Path(output),
        defaults=dataclasses.replace(_gen_params(gen), constraint=constraint),
        media=limits,
        columns=mapping,
        **data,
    )
    if not stages:
        return config
    made = _stage_settings(input, output, preset, generation or {}, media or {}, columns, given)
    return dataclasses.replace(config, stages=stages_of(stages, made))


def _check_outputs(data: dict[str, Any], output: str, mapping: Columns) -> None:
    """-o DIR/ (or a folder that exists) makes shards, which an OpenAI output file cannot be."""
    if output.endswith("/") or (not is_uri(output) and Path(output).is_dir()):
        data["output_shards"] = True
    if data.get("output_shards") and data.get("openai_output") is not None:
        raise ConfigError("--output-format openai/both writes one file: give -o a file name, not a folder")
    if mapping.prompt and data.get("prompt_template"):
        raise ConfigError("give --prompt-column or --prompt-template, not both")


def _stage_settings(
    input: str,
    output: str,
    preset: str | None,
    generation: dict,
    media: dict,
    columns: dict | None,
    given: dict,
) -> Callable[[dict[str, Any]], RunConfig]:
    """How a stage's settings are made: the job's (its preset, then what the caller gave), then
    the stage's own (`generation` and `media` merged key by key)."""

    def made(own: dict[str, Any]) -> RunConfig:
        gen, med = (
            {**generation, **(own.pop("generation", None) or {})},
            {**media, **(own.pop("media", None) or {})},
        )
        return build_config(input, output, preset, gen, med, columns, **{**given, **own, "stages": ()})

    return made


def _overlaid(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """The run-wide settings of a preset, `data`, overlaid with those given (None or an empty
    list: not given); a flag's name for its field's (engine: ray)."""
    for key in _LISTS:
        if isinstance(data.get(key), str):
            data[key] = (data[key],)
        if overrides.get(key) == ():
            overrides[key] = None
    if overrides.get("model") is not None and overrides.get("text_model") is None:
        data.pop("text_model", None)  # --model alone means that model for every row
    if overrides.get("models"):  # the preset's model(s) give way: rows that name none run on the first
        data.pop("text_model", None)
        if overrides.get("model") is None:
            data.pop("model", None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    for name, flag in FLAG_NAMES.items():
        if flag in data:
            data[name] = data.pop(flag)


def _media_config(med: dict[str, Any]) -> MediaConfig:
    """The media settings (MediaConfig checks their ranges)."""
    media_fields = {f.name for f in dataclasses.fields(MediaConfig)}
    if set(med) - media_fields:
        raise ConfigError(f"unknown media setting(s): {', '.join(sorted(set(med) - media_fields))}")
    return MediaConfig(**med)


def _check_run_settings(data: dict[str, Any]) -> None:
    """The run-wide settings a person writes as text, read in place (a shard `0/4`, a duration
    `55m`, a path); RunConfig checks every value's range itself."""
    shard = data.get("shard")
    if shard is not None:
        if isinstance(shard, str):
            try:
                shard = tuple(int(x) for x in shard.split("/"))
            except ValueError:
                shard = ()
        if not isinstance(shard, (tuple, list)) or len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ConfigError(f"--shard {data['shard']!r}: expected i/N with 0 <= i < N, e.g. 0/4")
        data["shard"] = tuple(shard)
    if data.get("time_limit") is not None:
        data["time_limit"] = parse_duration(data["time_limit"])
    if data.get("adapter") is not None or data.get("adapters"):
        _check_adapters(data)
    if data.get("errors_file") is not None and not is_uri(str(data["errors_file"])):
        data["errors_file"] = Path(data["errors_file"])


def _named(value: object, flag: str, what: str, reserved: str | None = None) -> dict[str, str]:
    """A set rows choose from by name (`name=VALUE,name=VALUE` as a flag gives it, a preset's
    mapping, or pairs), each name once and none `reserved`."""
    if isinstance(value, str):
        value = [tuple(part.split("=", 1)) for part in value.split(",") if part.strip()]
    elif isinstance(value, dict):
        value = list(value.items())
    pairs: dict[str, str] = {}
    for pair in value if isinstance(value, (list, tuple)) else [value]:
        name, target = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
        if not (isinstance(name, str) and SET_NAME.fullmatch(name) and name != reserved):
            other = f" other than {reserved!r}" if reserved else ""
            raise ConfigError(
                f"{flag}: expected name={what}, a name of letters, digits, _ . : / -{other}; got {pair!r:.80}"
            )
        if name in pairs:
            raise ConfigError(f"{flag}: {name!r} given twice")
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{flag} {name}: expected {what}, got {target!r:.60}")
        pairs[name] = target
    return pairs


def _check_adapters(data: dict[str, Any]) -> None:
    """The run's adapter and the named ones rows choose (--adapters name=FOLDER,..., or a preset's
    `adapters:` mapping): folders with their two files, for the one model they were trained on
    (a separate text model would be a second base). --adapter may name one of the set."""
    named = _named(data.get("adapters") or (), "--adapters", "FOLDER", BASE_ADAPTER)
    pairs = {name: _adapter_folder(folder, f"--adapters {name}") for name, folder in named.items()}
    data["adapters"] = tuple(pairs.items())
    adapter = data.get("adapter")
    if adapter is not None:
        data["adapter"] = pairs.get(adapter) or _adapter_folder(adapter, "--adapter")
    text = data.get("text_model")
    if text is not None and text != data.get("model"):
        why = "an adapter fits the one model it was trained on (--model); run the text rows apart"
        raise ConfigError(f"--adapter(s) with --text-model {text!r}: {why}")


def _check_models(data: dict[str, Any]) -> None:
    """The models rows choose by name (--models name=PATH,..., or a preset's `models:` mapping).
    --model may name one of them, and without --model rows that name none run on the first.
    What pairs with one model (a drafter, adapters, a text model) is refused beside them."""
    pairs = _named(data["models"], "--models", "PATH")
    data["models"] = tuple(pairs.items())
    model = data.get("model")
    data["model"] = pairs.get(model, model) if model else next(iter(pairs.values()))
    for key in ("draft_model", "adapter", "adapters", "text_model"):
        if data.get(key):
            flag = FLAG_NAMES.get(key, key).replace("_", "-")
            raise ConfigError(f"--models with --{flag}: it pairs with one model; run that model's rows apart")


def _adapter_folder(value: object, flag: str) -> str:
    """An adapter folder's absolute path, once it has its two files."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{flag}: expected a folder, got {value!r:.60}")
    folder = Path(value).expanduser()
    try:
        adapter_config(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {value!r}: {e}") from None
    return str(folder.resolve())


def _constraint(gen: dict[str, Any]) -> Constraint | None:
    """The run's output constraint (--json-schema FILE, --guided-choice, --guided-regex, or the
    same keys under a preset's `generation:`), taken out of `gen`."""
    given = {k: gen.pop(k) for k in CONSTRAINT_FIELDS if gen.get(k) not in (None, (), [])}
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}
    problems: list[tuple[str, str]] = []
    constraint = constraint_of(given, problems)
    if problems:
        raise ConfigError("; ".join(f"{k}: {msg}" for k, msg in problems))
    return constraint


def build_columns(preset: object, flags: dict[str, Any]) -> Columns:
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

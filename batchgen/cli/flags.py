"""Command-line flags as a run's settings; the one way a setting's error ends the process."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.errors import BatchgenError, ConfigError
from ..core.settings import GEN_FIELDS, RunConfig
from ..core.uris import is_uri
from ..execution.config import build_config, read_json_settings
from .options import COLUMN_FLAGS, MEDIA_FLAGS
from .process import say

__all__ = ["fail", "config_from_flags", "default_output"]


def fail(e: BatchgenError) -> None:
    say(f"error: {e}", "ERROR")
    sys.exit(e.exit_code)


def default_output(job_file: str) -> str:
    if is_uri(job_file):
        fail(ConfigError("a job given as a URI needs -o (a file, DIR/ for shards, or a URI)"))
    job = Path(job_file.rstrip("/") or job_file)
    return str(job.with_name(job.name.split(".")[0].rstrip("*") + ".results.parquet"))


def config_from_flags(
    job_file: str | Path, output: str | Path, preset: str | None, output_format: str, **flags
) -> tuple[RunConfig, Path | None]:
    """The run's settings from the command line's flags (and its OpenAI output path)."""
    generation = {k: flags.pop(k) for k in GEN_FIELDS if k in flags}
    generation["stop"] = list(generation["stop"]) or None
    schema_file = flags.pop("json_schema_file", None)
    if schema_file is not None:
        try:
            generation["json_schema"] = read_json_settings(schema_file, "--json-schema")
        except ConfigError as e:
            fail(e)
    generation["guided_choice"] = list(flags.pop("guided_choice", ()) or ()) or None
    generation["guided_regex"] = flags.pop("guided_regex", None)
    media = {k: flags.pop(k) for k in MEDIA_FLAGS}
    columns = {key: flags.pop(flag, None) for flag, key in COLUMN_FLAGS.items()}  # caption has none
    output, openai_output = _outputs(output, output_format)
    try:
        config = build_config(
            job_file, output, preset, generation, media, columns, openai_output=openai_output, **flags
        )
    except BatchgenError as e:
        fail(e)
    return config, openai_output


def _outputs(given: str | Path, output_format: str) -> tuple[str | Path, Path | None]:
    """(Parquet path, OpenAI output path). With `openai` the Parquet, which holds the state a
    rerun resumes from, sits beside the JSONL under the same name."""
    if output_format == "parquet":
        return given, None
    if is_uri(str(given)) or str(given).endswith("/"):
        fail(ConfigError("--output-format openai/both writes a local file: give -o a file name"))
    output = Path(given)
    if output_format == "openai":
        return output.with_suffix(".parquet") if output.suffix != ".parquet" else output.with_suffix(
            ".results.parquet"
        ), output
    return output, output.with_suffix(".openai.jsonl")

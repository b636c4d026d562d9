"""The options of `run`, `caption` and `validate`, declared once (options.py: how)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from ..core.errors import BatchgenError
from ..core.settings import Columns, MediaConfig
from .options import COLUMN_HELP, MEDIA_HELP, option

__all__ = ["run_options", "caption_options", "validate_options", "COLUMN"]


def _generation_options() -> list:
    """One option per generation parameter (params.PARAMS), showing the default a run without
    --config uses: the default preset's where it sets one, else the built-in one."""
    from ..core.params import PARAMS
    from ..execution.config import find_preset, load_preset

    try:
        preset = load_preset(find_preset(None)).get("generation") or {}
    except BatchgenError:
        preset = {}
    options = []
    for p in PARAMS:
        if p.cli is None:
            continue
        default = preset.get(p.name, p.default)
        shown = "none" if default in (None, ()) else default
        origin = " from the default preset" if p.name in preset else ""
        kind = {"is_flag": True, "default": None} if p.cli is bool else {"type": p.cli}
        options.append(
            option(
                f"--{p.name.replace('_', '-')}",
                multiple=p.name in ("stop", "choices_to_score"),
                help=f"{p.help} [{shown}{origin}].",
                **kind,
            )
        )
    return options


COLUMN = {"metavar": "NAME"}


def _column_options() -> list:
    """--id-column and the other mappings of a job file's columns onto a row's parts, one a
    Columns field (those holding several columns repeatable)."""
    several = {f.name for f in dataclasses.fields(Columns) if isinstance(getattr(Columns(), f.name), tuple)}
    return [
        option(f"--{name}-column", multiple=name in several, help=text, **COLUMN)
        for name, text in COLUMN_HELP.items()
    ]


_TEMPLATE = option("--prompt-template", help='Prompt made from each row\'s columns, e.g. "Describe {title}".')


def validate_options(command):
    """`validate`'s: the column mapping and the prompt template, as `run` takes them."""
    for decorate in reversed([*_column_options(), _TEMPLATE]):
        command = decorate(command)
    return command


def _output_options() -> list:
    """What the output holds and where, and how reruns treat earlier rows."""
    return [
        option(
            "--keep-columns", multiple=True, help="Carry these binary columns to the output too (repeatable)."
        ),
        option(
            "--drop-columns", multiple=True, help="Do not carry these columns to the output (repeatable)."
        ),
        option(
            "--result-columns",
            type=click.Choice(["all", "slim"]),
            help="slim: leave out how each row was made (token counts, timings, model) [all].",
        ),
        option(
            "--drop-result-columns",
            multiple=True,
            help="Leave out these of batchgen's columns (repeatable; never id, status, error, resume's).",
        ),
        option(
            "--output-format",
            type=click.Choice(["parquet", "openai", "both"]),
            default="parquet",
            show_default=True,
            help="openai: -o is an OpenAI Batch JSONL, Parquet beside; both: Parquet at -o, JSONL beside.",
        ),
        option("--overwrite", is_flag=True, help="Start over instead of resuming."),
        option(
            "--output-shards",
            is_flag=True,
            default=None,
            help="-o is a folder of Parquet shards (as -o DIR/ is), read with pandas.read_parquet(DIR).",
        ),
    ]


def _scale_options() -> list:
    """Where rows run (here or on Ray) and which share of the job."""
    return [
        option("--engine", type=click.Choice(["local", "ray"]), help="Where rows run [local]."),
        option("--ray-address", help="Join this Ray cluster (e.g. ray://head:10001) [a local Ray]."),
        option("--workers", type=int, help="Ray actors, one model load each [1]."),
        option(
            "--shard",
            help="Only shard i of N, e.g. 0/4, for job arrays: by a stable hash of the row's "
            "pictures (rows sharing one are one shard's), else of its id.",
        ),
    ]


def _media_options() -> list:
    """How media are fetched and decoded: a flag each for MEDIA_FLAGS, typed and defaulted as
    MediaConfig's field."""
    defaults, options = MediaConfig(), []
    for name, text in MEDIA_HELP.items():
        flag, default = f"--{name.replace('_', '-')}", getattr(defaults, name)
        if isinstance(default, bool):
            options.append(option(flag, is_flag=True, default=None, help=f"{text}."))
        elif default is None:  # a folder
            options.append(option(flag, type=click.Path(file_okay=False), help=f"{text}."))
        else:
            options.append(option(flag, type=type(default), help=f"{text} [{default}]."))
    return options


def _draft_options() -> list:
    """Speculative decoding."""
    return [
        option("--draft-model", help="Draft model (text) or drafter (vision) for speculative decoding."),
        option("--num-draft-tokens", type=int, help="Text drafts per round [3]."),
        option(
            "--draft-kind", type=click.Choice(["mtp", "dflash", "eagle3"]), help="Vision drafter kind [auto]."
        ),
        option("--draft-block-size", type=int, help="Vision drafter block size, >= 2 [the drafter's]."),
    ]


def _reuse_options() -> list:
    """Batch width, memory, the KV cache and prefix reuse."""
    return [
        option("--batch-size", type=int, help="Rows decoded together at most; 1 is off [32]."),
        option(
            "--memory-budget",
            help="Memory the run may use: auto (the device's working set; 60% of RAM on the CPU), "
            "a size (24GB, 7.5GiB), a share (50%) or off; rows join a batch while it fits [auto].",
        ),
        option(
            "--kv-bits",
            type=int,
            help="Quantize the KV cache to 8, 6, 5, 4, 3 or 2 bits, as the engines' own generate does; "
            "rows then run one at a time (no batch cache merges quantized ones) [off].",
        ),
        option(
            "--kv-group-size",
            type=int,
            help="Values per quantization group (32, 64, 128); it must divide the head size [64].",
        ),
        option(
            "--quantized-kv-start",
            type=click.IntRange(min=0),
            help="Tokens kept in full precision before the cache is quantized [0].",
        ),
        option(
            "--static-batches",
            "continuous",
            flag_value=False,
            default=None,
            help="Run batches to their end (no refilling of finished rows' slots), to compare.",
        ),
        option("--window", type=int, help="Rows looked ahead to group shared images [256]."),
        option(
            "--no-plan-aside",
            "plan_aside",
            flag_value=False,
            default=None,
            help="Plan each window's rows between windows, not on a thread while the one before "
            "decodes (which holds a second window's processed inputs).",
        ),
        option(
            "--plan-horizon",
            type=int,
            help="MiB of rows held back so rows sharing a picture run together, wherever they stand "
            "in the job; 0: job order [512].",
        ),
        option("--row-timeout", type=float, help="Seconds a row may generate; past it, a row error [none]."),
        option(
            "--no-cache", "cache", flag_value=False, default=None, help="No prompt-prefix reuse across rows."
        ),
    ]


def _rerun_options() -> list:
    """How a rerun treats failed and changed rows, what ends a run, what it reports."""
    return [
        option("--fail-fast", is_flag=True, help="Stop at the first failed row (exit 1)."),
        option(
            "--max-attempts",
            type=int,
            help="Runs a row that failed transiently (server down, timeout, engine error) gets [3].",
        ),
        option("--retry-failed", is_flag=True, default=None, help="Try every failed row again."),
        option(
            "--redo-repetition",
            type=float,
            metavar="PENALTY",
            help="Generate the rows the loop stop ended again, with this repetition penalty (e.g. 1.3).",
        ),
        option(
            "--changed",
            type=click.Choice(["refuse", "redo", "keep"]),
            help="Rows changed since their results were written: refuse the run, generate them "
            "again, or keep their results [refuse].",
        ),
        option(
            "--time-limit",
            help="Take no batch that would end past this (55m, 2h, 1h30m); the run "
            "then ends incomplete, and the next resumes [none].",
        ),
        option(
            "--fail-on",
            type=click.Choice(["any", "new", "none"]),
            help="Which failed rows make the exit code 1: any in the output, new (failed by this "
            "run), or none [any].",
        ),
        option(
            "--require-complete",
            is_flag=True,
            default=None,
            help="Exit 4 when rows are left to do (--limit, --time-limit).",
        ),
        option("--errors-file", help="The failed rows' list, a JSON line each [OUTPUT.errors.jsonl]."),
        option(
            "-q",
            "--quiet",
            is_flag=True,
            default=None,
            help="No progress bar and no info lines: warnings, errors and the closing lines only.",
        ),
    ]


def run_options(command, columns: bool = True):
    """The options `run` and `caption` share: models, presets, generation, media, output."""
    options = [
        option("-m", "--model", help="Checkpoint folder or Hugging Face id [from the config]."),
        option("--text-model", help="Model for rows without media [--model]."),
        option("--adapter", help="LoRA/DoRA adapter folder for --model, as mlx-lm or mlx-vlm saves one."),
        option("--adapters", help="Adapters rows name in their `adapter` field: name=FOLDER,name=FOLDER."),
        option(
            "--fuse-adapters",
            is_flag=True,
            default=None,
            help="Fuse each adapter into the weights as it is applied: rows decode at the base model's "
            "speed and equal the `mlx_lm fuse`d model's, not the LoRA layers'.",
        ),
        option("--models", help="Models rows name in their `model` field: name=PATH,name=PATH."),
        option("-c", "--config", "preset", help="Preset name in configs/ or a YAML path [default]."),
        _TEMPLATE,
        *(_column_options() if columns else []),
        *_output_options(),
        *_scale_options(),
        *_generation_options(),
        option(
            "--json-schema",
            "json_schema_file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Every row answers JSON matching this schema file (a row's own constraint wins).",
        ),
        option("--guided-choice", multiple=True, help="Every row answers one of these (repeatable)."),
        option("--guided-regex", help="Every row answers text matching this regular expression."),
        *_media_options(),
        *_draft_options(),
        *_reuse_options(),
        *_rerun_options(),
    ]
    for decorate in reversed(options):
        command = decorate(command)
    return command


def caption_options(command):
    """`run`'s options less the column flags: a folder of files has no columns to map."""
    return run_options(command, columns=False)

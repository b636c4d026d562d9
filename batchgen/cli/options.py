"""How an option is declared (with its environment variable) and how `run --help` lists them.

Each option reads the environment variable named after its flag; `run --help` lists them in
sections (input, models, generation, media, reuse, drafts, scale-out, output and reruns).
`option_lists` declares them.
"""

from __future__ import annotations

import os
from typing import Any

import click

__all__ = [
    "Sectioned",
    "EnvOption",
    "option",
    "variables",
    "COLUMN_FLAGS",
    "COLUMN_HELP",
    "MEDIA_FLAGS",
    "MEDIA_HELP",
]

# The media settings a flag sets, and its help; its type and default are MediaConfig's.
MEDIA_HELP = {
    "video_fps": "Frames sampled per second of video",
    "video_max_frames": "Most frames per video",
    "allow_private_urls": "URLs may reach private hosts",
    "media_cache": "Keep downloads here across runs",
    "media_root": "Local media paths must lie inside it",
    "fetch_workers": "Downloads in flight",
    "decode_workers": "Image/video decodes at once",
}
MEDIA_FLAGS = tuple(MEDIA_HELP)

# Each column mapping (a Columns field, `--<field>-column`), and its help; [the column read without it].
COLUMN_HELP = {
    "id": "Column holding each row's id [id].",
    "prompt": "Column holding the prompt [prompt].",
    "system": "Column holding the system prompt [system].",
    "score": "Column whose text is scored as the answer [score_text].",
    "image": "Column holding images (repeatable) [image, images].",
    "video": "Column holding videos (repeatable) [video, videos].",
}
COLUMN_FLAGS = {f"{name}_column": name for name in COLUMN_HELP}  # option name → Columns field


# `run --help` in sections, by option name (the generation options are all the rest).
_SECTIONS = {
    "Input": (
        "paths",
        "job_file",
        "output",
        "fmt",
        "limit",
        "prompts",
        "extensions",
        "prompt_template",
        *COLUMN_FLAGS,
        "shard",
    ),
    "Models": ("model", "text_model", "adapter", "adapters", "fuse_adapters", "models", "preset"),
    "Media": MEDIA_FLAGS,
    "Reuse and batching": (
        "batch_size",
        "memory_budget",
        "kv_bits",
        "kv_group_size",
        "quantized_kv_start",
        "continuous",
        "window",
        "plan_horizon",
        "plan_aside",
        "cache",
        "row_timeout",
    ),
    "Drafts": ("draft_model", "num_draft_tokens", "draft_kind", "draft_block_size"),
    "Scale-out": ("engine", "ray_address", "workers"),
    "Output and reruns": (
        "output_format",
        "output_shards",
        "write_captions",
        "keep_columns",
        "drop_columns",
        "result_columns",
        "drop_result_columns",
        "overwrite",
        "fail_fast",
        "max_attempts",
        "retry_failed",
        "redo_repetition",
        "changed",
        "time_limit",
        "fail_on",
        "require_complete",
        "errors_file",
        "quiet",
        "help",
    ),
}


class EnvOption(click.Option):
    """An option whose environment variable is named after its flag — `--prompt` reads
    BATCHGEN_CAPTION_PROMPT, whatever the parameter is called — and whose repeatable values
    come one per line (a prompt or a stop string holds spaces)."""

    def envvar_name(self, prefix: str | None) -> str | None:
        if prefix is None:
            return None
        flag = max((o for o in self.opts if o.startswith("--")), key=len, default=f"--{self.name}")
        return f"{prefix}_{flag[2:].upper().replace('-', '_')}"

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        name = self.envvar_name(ctx.auto_envvar_prefix) if self.allow_from_autoenv else None
        return (os.environ.get(name) or None) if name else None

    def value_from_envvar(self, ctx: click.Context) -> Any:
        if self.multiple or self.nargs != 1:
            value = self.resolve_envvar_value(ctx)
            return None if value is None else [line for line in value.splitlines() if line.strip()]
        return super().value_from_envvar(ctx)


def option(*decls: str, **attrs: Any):
    """click.option, with the variable named after the flag (EnvOption)."""
    return click.option(*decls, cls=EnvOption, **attrs)


def variables(group: click.Group) -> set[str]:
    """Every environment variable the command line reads: its own options' and each command's."""
    names = {p.envvar_name("BATCHGEN") for p in group.params if isinstance(p, EnvOption)}
    for name, command in group.commands.items():
        prefix = f"BATCHGEN_{name.upper().replace('-', '_')}"
        names |= {p.envvar_name(prefix) for p in command.params if isinstance(p, EnvOption)}
    return {n for n in names if n}


class Sectioned(click.Command):
    """A command whose --help lists its options in sections (input, models, generation, …),
    and whose bad option values name the environment variable they came from, if one did."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as e:
            param = e.param
            if (
                param is not None
                and param.name
                and (ctx.get_parameter_source(param.name) is click.core.ParameterSource.ENVIRONMENT)
            ):
                variable = (
                    param.envvar_name(ctx.auto_envvar_prefix)
                    if isinstance(param, EnvOption)
                    else param.envvar
                )
                raise click.BadParameter(
                    f"{e.message} (from the environment variable {variable})", ctx=e.ctx, param=param
                ) from None
            raise

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        section_of = {name: title for title, names in _SECTIONS.items() for name in names}
        rows: dict[str, list[tuple[str, str]]] = {
            title: [] for title in ("Input", "Models", "Generation", *_SECTIONS)
        }
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rows[section_of.get(param.name or "", "Generation")].append(record)
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)

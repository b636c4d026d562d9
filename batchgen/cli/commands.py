"""Command line: parses flags, builds a RunConfig, calls the library, maps errors to exit codes."""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..core.budget import human_bytes
from ..core.errors import BatchgenError, Interrupted, plural
from ..core.rules import LOOP_SPAN
from ..input.formats import FORMATS
from ..tools.export import ExportOptions
from ..tools.tiny.builder import KINDS
from .flags import config_from_flags, default_output, fail
from .option_lists import caption_options, run_options, validate_options
from .options import COLUMN_FLAGS, Sectioned, option, variables
from .process import ProgressDisplay, Signals, configure_logging, say
from .results import export, export_results, inspect_results, merge, report
from .serve import serve
from .status import status

if TYPE_CHECKING:
    from ..generate.generator import GeneratorFactory

__all__ = ["main", "Seams"]


@dataclass(frozen=True, slots=True)
class Seams:
    """What a caller embedding the command line gives it (Click's `obj`: `main(obj=Seams(...))`,
    or CliRunner's): the factory a run makes its generators with (a test's scripted one)."""

    generator: GeneratorFactory | None = None


CRASH_EXIT = 3  # an internal error (a bug), not a row (1) or a setting (2); finished rows are kept


def _crashed(e: Exception) -> None:
    """One line naming the error and where its full traceback was written, then exit 3."""
    import tempfile
    import time
    import traceback

    from ..core.errors import short

    path = Path(tempfile.gettempdir()) / f"batchgen-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    try:
        path.write_text("".join(traceback.format_exception(e)))
        where = f"full traceback in {path}"
    except OSError:
        where = "the traceback could not be saved"
    say(
        f"error: internal error {type(e).__name__}: {short(e)} ({where}); finished rows are kept, "
        "rerun to resume",
        "ERROR",
    )
    sys.exit(CRASH_EXIT)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "BATCHGEN"})
@click.version_option(package_name="batchgen")
@option("-v", "--verbose", count=True, help="More log lines: -v a line per window and lane, -vv per row.")
@option(
    "--log-level",
    type=click.Choice(["trace", "debug", "info", "warning", "error"]),
    help="batchgen's log level [info; -v debug, -vv trace]; other libraries log warnings.",
)
def main(verbose: int, log_level: str | None) -> None:
    """Batch generation with MLX: a job in (JSONL, Parquet, CSV, an OpenAI Batch file, or a
    folder, glob or URI of such shards or of WebDataset tars), a Parquet of results out.

    Every option can also be set from the environment: BATCHGEN_<COMMAND>_<FLAG>, e.g.
    BATCHGEN_RUN_MAX_TOKENS=64, BATCHGEN_CAPTION_PROMPT or BATCHGEN_LOG_LEVEL=info; a repeatable
    option takes one value per line."""
    configure_logging(log_level.upper() if log_level else ("INFO", "DEBUG", "TRACE")[min(verbose, 2)])
    known = variables(main)
    for name in sorted(n for n in os.environ if n.startswith("BATCHGEN_") and n not in known):
        near = difflib.get_close_matches(name, known, 1, 0.8)
        hint = (
            f"; did you mean {near[0]}?"
            if near
            else " (BATCHGEN_<COMMAND>_<FLAG>, e.g. BATCHGEN_RUN_MAX_TOKENS)"
        )
        say(f"warning: {name} is not a batchgen variable and is ignored{hint}", "WARNING")


for command in (status, inspect_results, export, report, merge, serve):  # cli/status, results, serve
    main.add_command(command)


@main.command(cls=Sectioned)
@click.argument("job_file")
@option("-o", "--output", help="Result Parquet, or DIR/ for a folder of shards [JOB_FILE.results.parquet].")
@option(
    "--format",
    "fmt",
    type=click.Choice(list(FORMATS)),
    help="Job format [by extension; .tar: webdataset].",
)
@option("--limit", type=int, help="Only the first N rows of the job file.")
@option("--dry-run", is_flag=True, help="Say what the run would do and cost (`batchgen plan`); run nothing.")
@run_options
def run(job_file: str, output: str | None, fmt: str | None, dry_run: bool, **flags) -> None:
    """Generate for every row of JOB_FILE; rerun the same command to resume.

    JOB_FILE is a JSONL, Parquet, CSV or OpenAI Batch file, a folder or glob of such shards
    or of WebDataset tars, or the same as an s3://, gs:// or hf:// URI. Generation options set
    the run's defaults (shown as a run without --config gets them); a row's own values win.

    \b
    Most runs need only these:
      batchgen run jobs.jsonl -o out.parquet --config qwen2.5-vl-captioning
      batchgen run jobs.jsonl -o out.parquet --model mlx-community/Qwen3-VL-4B-Instruct-4bit --max-tokens 256
      batchgen run shards/ -o out/ --image-column jpg --id-column key --prompt-template "Describe it."
      batchgen run jobs.jsonl -o out.parquet --limit 10        # try a few rows first
    Rerun the same command to resume; `batchgen inspect out.parquet` to see how it went."""
    output = output or default_output(job_file)
    if dry_run:
        _plan(job_file, output, format=fmt, **flags)
        return
    sys.exit(_run(job_file, output, format=fmt, **flags))


@main.command(cls=Sectioned)
@click.argument("job_file")
@option("-o", "--output", help="The run's output: rows already in it are not to do [as run].")
@option("--format", "fmt", type=click.Choice(list(FORMATS)), help="Job format [by extension].")
@option("--limit", type=int, help="Only the first N rows of the job file.")
@option(
    "--calibrate",
    type=click.IntRange(min=0),
    default=0,
    help="Generate the plan's first N rows (into no output) and project the run's wall time.",
)
@option("--json", "as_json", is_flag=True, help="The plan as one JSON object on stdout.")
@run_options
def plan(job_file: str, output: str | None, fmt: str | None, **flags) -> None:
    """Say what `batchgen run JOB_FILE` with these options would do, before it runs: rows and rows
    to do, distinct pictures and clips, rows sharing them, the prompt tokens the model will see
    (counted with its tokenizer, chat template and processor; no weights read), the prefill the
    prefix cache would serve, the lanes rows go to and why a row runs alone. Writes nothing."""
    _plan(job_file, output or default_output(job_file), format=fmt, **flags)


def _plan(job_file: str, output: str, calibrate: int = 0, as_json: bool = False, **flags) -> None:
    import json

    from ..execution.plan import PlanReport, plan_job
    from ..execution.plan_stages import StagedPlan, plan_stages

    config, _ = config_from_flags(job_file, output, **flags)
    try:
        report: PlanReport | StagedPlan = (plan_stages if config.stages else plan_job)(config, calibrate)
    except BatchgenError as e:
        fail(e)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo("\n".join(report.lines()))


@main.command(cls=Sectioned)
@click.argument("paths", nargs=-1, required=True)
@option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Result Parquet.")
@option("-p", "--prompt", "prompts", multiple=True, help="A question for every file (repeatable).")
@option("--ext", "extensions", multiple=True, help="File extensions to take [common image and video ones].")
@option(
    "--write-captions",
    type=click.Choice(["txt", "imagefolder"]),
    help="Then export: a .txt beside each image (prompts' answers joined by a space), or an "
    "imagefolder metadata.jsonl (see `export`).",
)
@option(
    "--then-score",
    help="A second stage: this yes/no question about each picture, its caption as {caption}, "
    "scored as P(Yes) (columns score.*).",
)
@option("--keep-if", help="With --then-score: the rows to keep, e.g. 'score > 0.5' (dropped_at says where).")
@caption_options
def caption(
    paths: tuple[str, ...],
    output: Path,
    prompts: tuple[str, ...],
    extensions: tuple[str, ...],
    write_captions: str | None,
    then_score: str | None,
    keep_if: str | None,
    **flags,
):
    """Caption image and video files: PATHS are files, folders (recursive) or globs; one row
    per file and prompt. A rerun skips files already captioned and takes new ones, and exits 1
    only for pictures that failed in it (--fail-on new, caption's default: a picture broken for
    good fails once). A --prompt-template may name {caption_txt}: each image's caption file
    beside it ("" if none)."""
    from ..tools.caption import SIDECAR_FIELD, write_caption_jobs

    if not prompts and not flags.get("prompt_template"):
        fail(BatchgenError("give at least one --prompt (or a --prompt-template)"))
    if then_score is not None or keep_if is not None:
        flags["stages"] = _scored_stages(then_score, keep_if, write_captions)
    try:
        sidecars = SIDECAR_FIELD in (flags.get("prompt_template") or "")
        job_file = write_caption_jobs(paths, prompts or ("",), output, extensions or None, sidecars)
    except BatchgenError as e:
        fail(e)
    if not flags.get("preset"):  # a preset decides these for itself
        if flags.get("stop_repetition") is None:
            flags["stop_repetition"] = LOOP_SPAN  # a caption that loops ends there
        if flags.get("fail_on") is None:
            flags["fail_on"] = "new"  # an old broken picture does not fail every rerun (caption && export)
    try:
        code = _run(job_file, output, **flags)
    except SystemExit as e:
        if e.code == 2:  # stopped before any work: the jobs file it was to read goes too
            job_file.unlink(missing_ok=True)
        raise
    if write_captions is not None:
        changed = "keep" if flags.get("changed") == "keep" else "refuse"  # kept rows keep their captions
        joined = " " if len(prompts) > 1 else None
        export_results(output, ExportOptions(write_captions, join=joined, changed=changed))  # type: ignore[arg-type]
    sys.exit(code)


def _scored_stages(question: str | None, keep_if: str | None, write_captions: str | None) -> list[dict]:
    """caption's --then-score and --keep-if as a staged job: the captions, then the question
    scored Yes/No with the caption in it (a VQAScore), its keep_if on the score."""
    if question is None:
        fail(BatchgenError("--keep-if needs --then-score (the stage whose values it reads)"))
    if write_captions is not None:
        fail(BatchgenError("--write-captions with --then-score: export a staged output is not done yet"))
    score: dict[str, Any] = {
        "name": "score",
        "prompt_template": question,
        "generation": {"choices_to_score": ["Yes", "No"], "score_only": True},
    }
    if keep_if is not None:
        score["keep_if"] = keep_if
    return [{"name": "caption"}, score]


def _run(job_file: str | Path, output: str | Path, **flags) -> int:
    """Run a job as the CLI does (progress, signals, the closing lines); the exit code."""
    from ..execution.stages import run as run_job

    config, openai_output = config_from_flags(job_file, output, **flags)
    seams = click.get_current_context().find_object(Seams) or Seams()
    display = ProgressDisplay(config, config.quiet, config.progress_seconds)
    try:
        with Signals() as signals:
            summary = run_job(config, progress=display, stop=signals.stop, generator=seams.generator)
    except Interrupted as e:
        display.close()
        say(f"error: stopped by {signals.name}; {e}", "ERROR")
        sys.exit(signals.exit_code)
    except BatchgenError as e:
        display.close()
        fail(e)
    except Exception as e:  # noqa: BLE001 - a bug: its own exit code, the traceback kept for the report
        display.close()
        _crashed(e)
    display.close()
    code = summary.exit_code(config.fail_on, config.require_complete)
    # A log grep finds a bad night: ERROR when the exit code says the run failed, WARNING when
    # rows failed tonight all the same (--fail-on none).
    say(summary.line(), "ERROR" if code else "WARNING" if summary.failed_now else "INFO")
    written = ", ".join(str(p) for p in (config.output, openai_output) if p)
    say(f"wrote {written}" if summary.generated else f"up to date: {written}")
    return code


@main.command()
@click.argument("job_file")
@option(
    "--format", "fmt", type=click.Choice(list(FORMATS)), help="Job format [by extension; .tar: webdataset]."
)
@validate_options
def validate(job_file: str, fmt: str | None, prompt_template: str | None, **flags) -> None:
    """Check every row of JOB_FILE as `run` would read it (with the same column mapping and
    prompt template); print each problem with its line, and warnings (fields one slip from
    one batchgen reads, columns that look like media but are not mapped); exit 1 if any problem."""
    from ..execution.config import build_columns
    from ..input.validate import validate_file

    count = 0
    try:
        columns = build_columns({}, {key: flags[flag] for flag, key in COLUMN_FLAGS.items()})
        checked = validate_file(job_file, fmt, columns, prompt_template)
        for finding in checked:
            click.echo(finding.line())
            count += 0 if finding.warning else finding.rows
    except BatchgenError as e:
        fail(e)
    if count:
        say(f"{plural(count, 'problem')} in {job_file} ({plural(checked.rows, 'row')} read)", "ERROR")
        sys.exit(1)
    say(f"{job_file}: ok, {plural(checked.rows, 'row')}")


@main.command("env")
def env() -> None:
    """Print what a bug report needs: platform, Python, the MLX backend and device, versions,
    and on Linux CPU the BLAS MLX multiplies with."""
    from ..generate.environment import environment

    e = environment()
    lines = [
        f"platform: {e.platform}",
        f"python: {e.python}",
        f"mlx backend: {e.backend}, default device {e.device}",
        f"memory budget (--memory-budget auto): {human_bytes(e.memory_budget)}, {e.memory_how}",
    ]
    lines += [f"{name}: {version or 'not installed'}" for name, version in e.versions.items()]
    if e.blas is not None:
        kind = " (the reference BLAS MLX's Linux CPU wheel ships: slow matmuls)" if e.reference_blas else ""
        lines.append(f"blas: {e.blas}{kind}")
        if e.preloaded:
            lines.append(f"blas preloaded: {os.environ.get('LD_PRELOAD')} (LD_PRELOAD)")
        elif e.reference_blas and e.faster_blas:
            lines += [
                f"faster blas installed: {e.faster_blas} (exports cblas_sgemm). Opt-in, at your own check:",
                f"  LD_PRELOAD={e.faster_blas} OPENBLAS_NUM_THREADS=1 batchgen run ...",
                "  (measured on a 2-core x86 box: captioning and text runs 2.3x faster, identical greedy",
                "  tokens; old OpenBLAS builds miscompute on some CPUs: compare a few rows with and without)",
            ]
    click.echo("\n".join(lines))


@main.command("make-tiny-model")
@click.argument("out_dir", type=click.Path(path_type=Path))
@option(
    "--kind",
    type=click.Choice(KINDS),
    default="vlm",
    show_default=True,
)
@option("--seed", type=int, default=0, show_default=True)
@option("--sensitive", is_flag=True, help="Outputs that vary with every input (for tests).")
@option("--bits", type=click.Choice(["4", "8"]), help="Quantize the language model (vision kinds).")
def make_tiny_model(out_dir: Path, kind: str, seed: int, sensitive: bool, bits: str | None) -> None:
    """Build a tiny random checkpoint that mlx-lm / mlx-vlm load offline.

    lm: qwen2 text model; vlm: qwen2_vl; qwen2_5_vl; qwen3_vl; qwen3_vl_moe; text-draft: a smaller
    qwen2 draft for lm; thinking-lm: lm with Qwen3's <think> markers, enable_thinking template and
    <tool_call> JSON tools; channel-lm: lm with Gemma 4's <|channel>thought … <channel|> markers;
    mtp-pair: DIR/target (qwen3_5 VLM) and DIR/drafter (its qwen3_5_mtp
    drafter); llava: llava (llama + CLIP); llava_next: LLaVA-NeXT; smolvlm: SmolVLM (llama +
    SigLIP-like, pixel shuffle); idefics3: Idefics3; gemma3: Gemma 3; gemma4: Gemma 4 (per-layer
    inputs, no audio tower); mistral3: Mistral 3 (Pixtral vision); internvl_chat: InternVL."""
    from ..tools.tiny.builder import make_tiny_model as build

    build(out_dir, kind=kind, seed=seed, sensitive=sensitive, bits=int(bits) if bits else None)
    say(f"wrote {kind} checkpoint to {out_dir}")

"""Before any work: the job scanned and checked, and the writer a run (or a plan) writes with."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..core.answers import answer_kinds, merge_kinds
from ..core.errors import ConfigError, short
from ..core.settings import RunConfig
from ..input.plan import share_keys
from ..input.read import JobIndex, scan
from ..input.source import Source, resolve
from ..input.template import has_field, template_fields
from ..output.about import About, JobAbout, MediaAbout
from ..output.openai_batch import BatchOutput
from ..output.parts import Earlier, partial_dir
from ..output.resume import Resume, settings_of
from ..output.run_files import OutputLock, errors_owned, errors_path, heartbeat_path
from ..output.shards import MirroredShards, Shards
from ..output.stats import stats_path
from ..output.store import Store
from ..output.tables import dropped_columns
from ..output.write import ResultWriter, SingleFile, WriteOptions

__all__ = ["open_job", "writer_for", "resume_of", "check_paths", "check_columns"]


def open_job(config: RunConfig) -> JobIndex:
    """The job scanned and checked (its outputs writable, its columns there, its ids unique),
    narrowed to its --shard and --limit: what a run or a plan starts from."""
    source = dataclasses.replace(
        resolve(config.input, config.format), caps=config.media.caps, video_columns=config.columns.video
    )
    if config.paths_from is not None:  # a staged job's later stage: the job's own folder
        source = dataclasses.replace(source, base=config.paths_from)
    check_paths(config, source)
    share = share_keys(config.columns)
    index = scan(source, id_column=config.columns.id, share=share)
    check_columns(config, index)
    if config.shard is not None or config.limit is not None:
        index = index.narrow(config.shard, config.limit)
    return index


def resume_of(config: RunConfig, index: JobIndex, writer: ResultWriter, earlier: Earlier) -> Resume:
    """What earlier runs on the output leave this one to do, under its settings (`earlier`: the
    output as the run opens it, or as a plan peeks at it)."""
    return Resume(
        earlier,
        writer.store,
        index,
        writer.settings,
        max_attempts=config.max_attempts,
        every_failure=config.retry_failed,
        changed=config.changed,
        redo_looped=config.redo_repetition is not None,
    )


def writer_for(config: RunConfig, index: JobIndex) -> ResultWriter:
    """The run's writer, in the output's layout, with the OpenAI Batch file as a sink if asked
    (a plan only peeks at what it holds)."""
    dropped = dropped_columns(index, config.keep_columns, config.drop_columns)
    options = WriteOptions(
        flush_rows=config.flush_rows,
        flush_seconds=config.flush_seconds,
        shard_rows=config.shard_rows,
        overwrite=config.overwrite,
        left_out=config.left_out,
        answers=_answer_columns(config, index),
    )
    layout: type[ResultWriter] = SingleFile
    if config.output_shards:  # a folder job (of several job files) gets a shard per job file
        layout = MirroredShards if index.source is not None and index.source.folder else Shards
    sinks = [BatchOutput(config.openai_output)] if config.openai_output is not None else []
    return layout(
        config.output,
        index,
        settings_of(config),
        options,
        skip=dropped,
        about=_about(config, index, dropped),
        sinks=sinks,
    )


def check_paths(config: RunConfig, source: Source) -> None:
    """Outputs that cannot be written, or that would replace a job file, stop the run before
    any work (exit 2), not after the first batch. Nothing is created here."""
    if isinstance(config.output, str):  # a URI: reachable now, or not at all
        _check_remote(config.output)
        return
    jobs = {p.resolve() for p in source.local_paths()}
    output, sharded = config.output, config.output_shards
    errors = Path(config.errors_file or errors_path(output, sharded))
    written = [
        (Path(output), "-o"),
        (Path(stats_path(output, sharded)), "the stats file"),
        (Path(partial_dir(output, sharded)), "the parts folder"),
        (errors, "--errors-file"),
    ]
    if config.openai_output is not None:
        written.append((config.openai_output, "--output-format's JSONL"))
    for path, flag in written:
        if path.resolve() in jobs:
            raise ConfigError(f"{flag} {path}: is the job file itself; choose another")
    if config.errors_file is not None:
        _check_errors(errors, config, written)
    if sharded and any(job.is_relative_to(output.resolve()) for job in jobs):
        raise ConfigError(f"-o {output}: the job's files are in it; choose another folder for the shards")
    if output.is_dir() and not sharded:
        raise ConfigError(f"-o {output}: is a folder; give a file name (e.g. {output / 'results.parquet'})")
    if output.exists() and not output.is_dir() and sharded:
        raise ConfigError(f"-o {output}/: a file, not a folder; choose another folder for the shards")
    for path, _ in written:
        folder = path.parent
        while not folder.exists() and folder != folder.parent:  # the nearest folder that exists
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot write {path}: {folder} is not a writable folder")


def _check_errors(errors: Path, config: RunConfig, written: list[tuple[Path, str]]) -> None:
    """--errors-file is written only where batchgen owns the name: never one of this run's own
    files (the results, their stats, heartbeat, lock or parts), nothing inside a folder of
    shards but its `_errors.jsonl`, and no file already there that this output's last run did
    not write — the job's media, a notes file, another output's results (removed when no row
    failed, before). Before any work, so nothing is lost."""
    output, sharded = Path(config.output), config.output_shards
    where = errors.resolve()
    own = [
        (Path(heartbeat_path(output, sharded)), "the heartbeat"),
        (OutputLock(output).path, "the lock"),
        *(pair for pair in written if pair[1] != "--errors-file"),
    ]
    for path, what in own:
        if where == path.resolve() or what == "the parts folder" and where.is_relative_to(path.resolve()):
            raise ConfigError(f"--errors-file {errors}: is {what} of this run; choose another name")
    if (
        sharded
        and where.is_relative_to(output.resolve())
        and where != Path(errors_path(output, True)).resolve()
    ):
        raise ConfigError(
            f"--errors-file {errors}: inside the folder of shards {output}; choose a name outside it"
        )
    if not errors_owned(errors, output, sharded, stats_path(output, sharded)):
        raise ConfigError(
            f"--errors-file {errors}: already there and not the error file this output's last run wrote "
            "(batchgen never writes over or removes a file it did not write); choose another name"
        )


def _check_remote(output: str) -> None:
    store = Store(output)
    parent = output.rsplit("/", 1)[0]
    try:
        store.exists(output), store.exists(parent)
    except Exception as e:  # noqa: BLE001 - credentials, an unknown bucket, no network
        raise ConfigError(f"-o {output}: cannot reach it ({type(e).__name__}: {short(e)})") from None


def check_columns(config: RunConfig, index: JobIndex) -> None:
    """Columns the settings name (mapping, kept or dropped columns, template fields) must be the
    file's: a typo stops the run before any work, listing the columns there are."""
    if not index.ids:
        return
    named = [
        *config.columns.named(),
        *(("--keep-columns", c) for c in config.keep_columns),
        *(("--drop-columns", c) for c in config.drop_columns),
    ]
    if config.prompt_template is not None:
        named += [("--prompt-template", name) for name in template_fields(config.prompt_template)]
    missing = [f"{flag} {name!r}" for flag, name in named if not has_field(index.columns, name)]
    if missing:
        shown = ", ".join(index.columns[:40]) + (" …" if len(index.columns) > 40 else "")
        raise ConfigError(f"{config.input}: no column {', '.join(missing)}; its columns: {shown}")


def _answer_columns(config: RunConfig, index: JobIndex) -> dict[str, str]:
    """The output's answer columns, decided before the first row is written: the run's
    schema's fields, then those of the schemas the job's rows give (their union)."""
    default = config.defaults.constraint
    union: dict[str, str] = {}
    merge_kinds(union, answer_kinds(default) if default is not None else ())
    merge_kinds(union, tuple(index.answers.items()))
    return union


def _about(config: RunConfig, index: JobIndex, dropped: set[str]) -> About:
    """What readers of the output need that its rows do not say: where the job's relative
    media paths start (report shows the pictures from any folder), which local media the run
    could read, the prompt template and how the job was read."""
    base, root, source = index.base, config.media.media_root, index.source
    local = source if source is not None and base is not None else None
    media = MediaAbout(
        local_paths=base is not None,
        media_root=str(Path(root).resolve()) if root else None,
        allow_private_urls=config.media.allow_private_urls,
    )
    job = JobAbout(  # the gallery shows pictures the output does not carry (bytes) from its path
        path=str(Path(local.given).resolve()) if local is not None else None,
        format=source.format if source is not None else None,
        id_column=config.columns.id,
        prompt=config.columns.prompt,  # the gallery and export read each row's question as the run did
        system=config.columns.system,
        image=tuple(config.columns.image),
        video=tuple(config.columns.video),
        not_carried=tuple(sorted(dropped)),  # the columns only the job holds (a dataset's image bytes)
    )
    return About(
        media_base=str(Path(base).resolve()) if base is not None else None,
        media=media,
        template=config.prompt_template,
        job=job,
    )

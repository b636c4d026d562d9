"""The commands that read a run's results back: `inspect`, `export`, `report` and `merge`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..core.errors import BatchgenError
from ..input.formats import FORMATS
from ..tools.export import FORMATS as EXPORT_FORMATS
from ..tools.export import ExportOptions
from .flags import fail
from .options import option
from .process import say

__all__ = ["inspect_results", "export", "report", "merge", "export_results"]


@click.command("inspect")
@click.argument("results", type=click.Path(path_type=Path, exists=True))
@option("--slowest", type=int, default=5, show_default=True, help="How many of the slowest rows to list.")
@option("--failed", is_flag=True, help="List every failed row instead: id, stage and error, tab-separated.")
@option("--json", "as_json", is_flag=True, help="With --failed: a JSON line each (attempts, transient too).")
def inspect_results(results: Path, slowest: int, failed: bool, as_json: bool) -> None:
    """Summarize a results file: statuses, errors by stage, tokens, reuse, drafts, slowest rows;
    or, with --failed, list its failed rows."""
    from ..tools.report import failed_rows, summarize

    try:
        text = failed_rows(results, as_json) if failed else summarize(results, slowest)
    except BatchgenError as e:
        fail(e)
    if text:
        click.echo(text)


@click.command()
@click.argument("results", type=click.Path(path_type=Path, exists=True))
@option(
    "--format",
    "fmt",
    type=click.Choice(EXPORT_FORMATS),
    required=True,
    help="txt: a caption file beside each image; imagefolder: metadata.jsonl; wide/jsonl: a row per image.",
)
@option(
    "--to",
    type=click.Path(path_type=Path, file_okay=False),
    help="txt: mirror the caption files under this folder; imagefolder: a new dataset folder.",
)
@option("-o", "--output", type=click.Path(path_type=Path), help="wide / jsonl: the file to write.")
@option("--caption-extension", default=".txt", show_default=True, help="txt: the caption files' extension.")
@option(
    "--caption-name",
    type=click.Choice(["stem", "with-extension"]),
    default="stem",
    show_default=True,
    help="txt: a.png's caption in a.txt, or in a.png.txt (two pictures share a stem).",
)
@option("--stage", help="A staged job's output: this stage's answers, of the rows kept to the end.")
@option("--prompt", help="Only this prompt's answers (its number, from 0, or its text).")
@option("--join", help="Every prompt's answers, in prompt order, joined by this.")
@option("--field", help="A JSON-schema answer's field as the caption (a list of tags joined by ', ').")
@option("--prefix", default="", help="Written before every caption (trigger words; include a separator).")
@option("--suffix", default="", help="Written after every caption.")
@option(
    "--on-existing",
    type=click.Choice(["skip", "overwrite", "append", "prepend"]),
    default="skip",
    show_default=True,
    help="txt: what to do with a caption file already there.",
)
@option(
    "--link",
    type=click.Choice(["copy", "hard", "symbolic"]),
    default="copy",
    show_default=True,
    help="imagefolder --to: copies of the pictures (a reflink where the filesystem can), "
    "so editing them never touches the originals; or hard or symbolic links.",
)
@option(
    "--changed",
    type=click.Choice(["refuse", "keep"]),
    default="refuse",
    show_default=True,
    help="A picture replaced since the run (a re-crop): leave it out, naming it (rerun with "
    "--changed redo to caption it again), or write its old caption anyway.",
)
def export(results: Path, fmt: str, to: Path | None, output: Path | None, **options) -> None:
    """Write a results file's answers where training tools read them, one caption per image.

    Only the media the run itself read are captioned, under the run's media policy; nothing
    is written over a media file, the results or the job, and a metadata.jsonl batchgen did
    not write is never replaced. A caption file batchgen wrote is refreshed when its answer
    changed; one it did not write is kept (--on-existing). Exits 1 when it wrote nothing, left
    a file alone, or left out a picture replaced since the run."""
    export_results(results, ExportOptions(fmt, to, output, **options))  # type: ignore[arg-type]


def export_results(results: Path, options: ExportOptions) -> None:
    from ..tools.export import export as run_export

    try:
        summary = run_export(results, options)
    except BatchgenError as e:
        fail(e)
    counts = (
        (summary.current, "up to date"),
        (summary.skipped, "already there, not batchgen's, kept"),
        (len(summary.changed), "changed since the run"),
        (summary.failed, "failed"),
        (summary.empty, "empty, not written"),
        (summary.missing, "media not found"),
        (summary.remote, "fetched from a URL, no local file"),
        (summary.as_bytes, "held as bytes, no file"),
        (summary.without_media, "without media"),
        (len(summary.refused), "left alone"),
        (len(summary.errors), "could not be written"),
    )
    left = ", ".join(f"{n} {what}" for n, what in counts if n) or "nothing left out"
    how = {"copy": "copied", "hard": "hard-linked", "symbolic": "linked"}[options.link]
    pictures = f"; {summary.pictures} pictures {how} or written there" if summary.pictures else ""
    where = f" to {', '.join(summary.where)}" if summary.where else ""
    say(f"wrote {summary.written} ({left}){where}{pictures}")
    for label, names in (
        ("changed since the run (rerun with --changed redo, or export --changed keep)", summary.changed),
        ("left alone", summary.refused),
        ("could not be written", summary.errors),
    ):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            say(f"{label}: {'; '.join(names[:3])}{more}", "WARNING")
    if summary.skipped:
        say(
            f"{summary.skipped} caption file(s) batchgen did not write (or edited since) kept as they are: "
            "--on-existing overwrite replaces them",
            "WARNING",
        )
    if summary.note:
        say(summary.note)
    if not summary.ok:
        sys.exit(1)


@click.command()
@click.argument("results", type=click.Path(path_type=Path, exists=True))
@option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The HTML page to write.")
@option(
    "--media-base",
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder the job's relative media paths start from [as the run recorded].",
)
@option(
    "--media-column",
    multiple=True,
    help="Also show the pictures in this column (paths, URLs or bytes; repeatable) "
    "[image, images, the run's --image-column].",
)
def report(results: Path, output: Path, media_base: Path | None, media_column: tuple[str, ...]) -> None:
    """Write a self-contained HTML gallery of a results file, one card per picture."""
    from ..tools.gallery import write_gallery

    try:
        cards, missing, base, changed = write_gallery(results, output, media_base, media_column)
    except BatchgenError as e:
        fail(e)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        where = f"relative paths start at {base}" if base else "a remote job's local paths are not opened"
        say(
            f"warning: {len(missing)} media not found, unreadable or refused: {shown} ({where}; "
            "--media-base to change it)",
            "WARNING",
        )
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        say(
            f"warning: {len(changed)} picture(s) changed since the run: {shown} (their cards say so: the "
            "answers are the old picture's; rerun with --changed redo)",
            "WARNING",
        )
    say(f"wrote {output} ({cards} cards)")


@click.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True))
@option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The merged Parquet.")
@option(
    "--job",
    "job_file",
    type=click.Path(path_type=Path),
    required=True,
    help="The job file the shards ran: it gives the order and the ids to expect.",
)
@option("--format", "fmt", type=click.Choice(list(FORMATS)), help="Job file format.")
def merge(parts: tuple[Path, ...], output: Path, job_file: Path, fmt: str | None) -> None:
    """Combine shard outputs (--shard i/N) into one, in job order; exit 1 if ids are missing
    or duplicated."""
    from ..input.read import scan
    from ..output.merge import merge_outputs

    try:
        rows, missing, duplicated = merge_outputs(list(parts), scan(job_file, fmt), output)
    except BatchgenError as e:
        fail(e)
    say(f"wrote {output} ({rows} rows from {len(parts)} parts)")
    for label, ids in (("missing", missing), ("duplicated", duplicated)):
        if ids:
            shown = ", ".join(map(repr, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
            say(f"{len(ids)} id(s) {label}: {shown}", "WARNING")
    sys.exit(1 if missing or duplicated else 0)

"""`batchgen status`: a job's state for a person or a script (cron's next step, a dashboard)."""

from __future__ import annotations

import sys

import click

from ..core.errors import BatchgenError
from ..tools.status import EXIT_CODES, as_json, exit_code, render, status_of
from .flags import fail
from .options import option

__all__ = ["status"]

_CODES = ", ".join(f"{code} {state}" for state, code in EXIT_CODES.items())


@click.command(epilog=f"Exit codes: {_CODES}, 2 nothing to read (no run wrote OUT).")
@click.argument("outputs", nargs=-1, required=True)
@option("--json", "as_json_", is_flag=True, help="One JSON object (several OUTs: their list and total).")
def status(outputs: tuple[str, ...], as_json_: bool) -> None:
    """Where the runs writing OUT stand: for one in progress its pid, host, start, rows done
    of those to do, rows/s, ETA and last committed batch; for a finished or stopped one its
    rows, ok, failed by stage, pending and how its last run ended; for a folder of shards
    each shard too. Several OUTs (--shard runs) are shown one by one, then in total."""
    try:
        statuses = [status_of(out) for out in outputs]
    except BatchgenError as e:
        fail(e)
    if as_json_:
        click.echo(as_json(statuses))
    else:
        click.echo("\n".join(render(s) for s in statuses))
        if len(statuses) > 1:
            rows, ok, failed, pending = (
                sum(getattr(s, k) for s in statuses) for k in ("rows", "ok", "failed", "pending")
            )
            click.echo(f"total: {rows:,} rows, {ok:,} ok, {failed:,} failed, {pending:,} pending")
    sys.exit(exit_code(statuses))

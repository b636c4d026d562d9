"""`inspect`: a results file summed up in the terminal (the gallery is gallery.py's)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ..core.errors import gist, one_line, plural
from ..output.about import About, Standing
from ..output.run_files import failed_records
from ..output.stats import Figures, read_figures, stats_path
from ..output.store import strict_json
from .results import made_by, read_results, results_schema, staged

__all__ = ["summarize", "failed_rows"]


def _spread(values: list[float]) -> str:
    values = sorted(values)
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"mean {sum(values) / len(values):.3f}, p10 {at(0.1):.3f}, median {at(0.5):.3f}, p90 {at(0.9):.3f}"


def _score_lines(rows: list[dict], recorded: set[str]) -> list[str]:
    """Scored rows: each choice's normalized probability and the texts' mean logprob, spread."""
    lines = []
    probs: dict[str, list[float]] = {}
    for r in rows:
        for c in r.get("choice_scores") or []:
            probs.setdefault(c["choice"], []).append(c["prob"])
    for choice, values in list(probs.items())[:8]:
        lines.append(f"scores: {choice!r:.40} prob over {len(values)} rows: {_spread(values)}")
    means = [r["score_mean"] for r in rows if r.get("score_mean") is not None and "score_mean" in recorded]
    if means:
        lines.append(f"scores: score_text logprob per token over {len(means)} rows: {_spread(means)}")
    return lines


def _loop_lines(rows: list[dict]) -> list[str]:
    looped = sum(r.get("finish_reason") == "repetition" for r in rows)
    if not looped:
        return []
    return [
        f"loops: {looped} rows ended repeating themselves (finish_reason repetition, their text up to "
        "the first repeat; a rerun with --redo-repetition 1.3 generates them again)"
    ]


def _answer_lines(rows: list[dict]) -> list[str]:
    """A thinking model's reasoning (and the rows it left without an answer), the tool calls made."""
    lines = []
    reasoned = [r for r in rows if r["status"] == "ok" and r.get("reasoning") is not None]
    if reasoned:
        tokens = sum(r.get("reasoning_tokens") or 0 for r in reasoned)
        unanswered = sum(
            not (r["generated_text"] or "").strip() and not r.get("tool_calls") for r in reasoned
        )
        line = f"reasoning: {len(reasoned)} rows reasoned first, {tokens} reasoning tokens"
        if unanswered:
            line += (
                f"; {unanswered} gave no answer (out of tokens while reasoning: raise max_tokens "
                "or set --reasoning-budget)"
            )
        lines.append(line)
    calls = Counter(c["function"]["name"] for r in rows for c in r.get("tool_calls") or [])
    if calls:
        rows_calling = sum(bool(r.get("tool_calls")) for r in rows)
        named = ", ".join(f"{one_line(name)} {n}" for name, n in calls.most_common(5))
        lines.append(f"tool calls: {sum(calls.values())} in {rows_calling} rows ({named})")
    return lines


def failed_rows(path: Path, as_json: bool = False) -> str:
    """`inspect --failed`: every failed row's id, stage and error, a line each (tab-separated),
    or as JSON lines with attempts and transient, as the run's error file has them."""
    records = failed_records(read_results(path))
    if as_json:
        return "\n".join(strict_json(r) for r in records)
    return "\n".join("\t".join(one_line(str(r[k])) for k in ("id", "stage", "error")) for r in records)


def summarize(path: Path, slowest: int = 5) -> str:
    """Rows by status, errors by stage with their commonest messages, tokens and speed,
    prefix reuse, draft acceptance, and the slowest rows; for a staged job's output, where its
    rows stopped, then each stage's own results so."""
    rows = read_results(path)
    ok = sum(r["status"] == "ok" for r in rows)
    lines = [f"{path}: {plural(len(rows), 'row')}, {ok:,} ok, {len(rows) - ok:,} failed"]
    lines += _error_lines(rows) + _group_lines(rows)
    stats_file = stats_path(path, path.is_dir())
    figures = read_figures(stats_file)
    if figures is None and os.path.lexists(stats_file):
        lines.append(
            f"{stats_file}: not a stats file batchgen wrote (damaged, or not a regular file): "
            "speed and completeness from the Parquet alone"
        )
    schema = results_schema(path)
    recorded = set(schema.names)  # a slim output holds no counts or timings
    if {"prompt_tokens", "completion_tokens"} <= recorded:
        lines.append(_token_line(rows, figures))
    if (left := _left(About.of(schema.metadata).standing, figures)) is not None:
        job_rows, pending = left
        lines.insert(
            1,
            f"incomplete: {len(rows):,} of {job_rows:,} rows, {pending:,} pending "
            "(rerun without --limit to finish)",
        )
    cached = [r["cached_tokens"] or 0 for r in rows if r["status"] == "ok"]
    reused = sum(c > 0 for c in cached)
    if cached and "cached_tokens" in recorded:
        lines.append(
            f"cache: {reused:,} of {plural(len(cached), 'row')} reused a prefix "
            f"({reused / len(cached):.0%} of rows), "
            f"{sum(cached):,} prompt tokens saved"
        )
    lines += _loop_lines(rows) + _answer_lines(rows) + _score_lines(rows, recorded)
    drafted = sum(r.get("mtp_drafts") or 0 for r in rows)
    if drafted:
        accepted = sum(r.get("mtp_accepted") or 0 for r in rows)
        lines.append(f"drafts: {accepted}/{drafted} accepted ({accepted / drafted:.0%})")
    lines += _slowest_lines(rows, recorded, slowest)
    for number, (name, results) in enumerate(staged(path).items(), 1):  # a staged job: each stage
        if number == 1:
            lines.append(_stopped_line(rows))
        lines.append(f"stage {number} {name}:")
        lines += [f"  {line}" for line in summarize(results, slowest).splitlines()]
    return "\n".join(map(one_line, lines))


def _stopped_line(rows: list[dict]) -> str:
    """A staged job's rows: how many went through every stage, and where the others stopped."""
    stopped = Counter(r["dropped_at"] for r in rows if r.get("dropped_at") is not None)
    where = "".join(f", {n:,} stopped at {stage}" for stage, n in stopped.most_common())
    return f"stages: {len(rows) - stopped.total():,} rows went through every stage{where}"


def _group_lines(rows: list[dict]) -> list[str]:
    """A run of several models or adapters: each one's rows, and how many are ok."""
    lines = []
    for column, values in made_by(rows).items():
        rows_of = Counter(values)
        ok_of = Counter(v for v, r in zip(values, rows, strict=True) if r["status"] == "ok")
        shown = ", ".join(f"{name} {n:,} ({ok_of[name]:,} ok)" for name, n in rows_of.most_common(20))
        more = f" and {len(rows_of) - 20} more" if len(rows_of) > 20 else ""
        lines.append(f"by {column}: {shown}{more}")
    return lines


def _error_lines(rows: list[dict]) -> list[str]:
    """Failed rows by stage, each stage's three commonest messages (their gist) with counts."""
    by_stage: dict[str, Counter[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            by_stage.setdefault(r["error_stage"] or "?", Counter())[
                gist(r["error"] or "", r["error_stage"])
            ] += 1
    lines = ["errors by stage:"] if by_stage else []
    for stage, messages in sorted(by_stage.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"  {stage:<9}{sum(messages.values()):>6}")
        lines += [f"    {n:>5} × {message}" for message, n in messages.most_common(3)]
    return lines


def _left(standing: Standing | None, figures: Figures | None) -> tuple[int, int] | None:
    """(job rows, pending) of an incomplete output, as its own metadata says it (a shard
    folder's stats file says it for the folder); None for a complete one."""
    if standing is None and figures is not None:
        standing = Standing(complete=figures.complete, job_rows=figures.job_rows, pending=figures.pending)
    if standing is None or standing.complete:
        return None
    return standing.job_rows, standing.pending


def _token_line(rows: list[dict], figures: Figures | None) -> str:
    """Tokens in and out, and the last run's speed where its stats file says it."""
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    completion = sum(r["completion_tokens"] or 0 for r in rows)
    speed = ""
    f = figures
    if f is not None and f.tokens_per_s is not None and f.rows_per_s is not None and f.wall_s is not None:
        speed = f" · last run {f.tokens_per_s:.1f} tok/s, {f.rows_per_s:.2f} rows/s over {f.wall_s:.1f} s"
    return f"tokens: {prompt:,} prompt, {completion:,} completion{speed}"


def _slowest_lines(rows: list[dict], recorded: set[str], slowest: int) -> list[str]:
    """The rows that took longest over all their stages, with each stage's share."""
    stages = ("fetch_ms", "decode_ms", "frames_ms", "generate_ms")
    if not any(k in recorded for k in stages):
        return []
    worst = sorted(rows, key=lambda r: sum(r[k] or 0 for k in stages), reverse=True)[:slowest]
    lines = ["slowest rows:"] if worst else []
    for r in worst:
        parts = ", ".join(f"{k[:-3]} {r[k]:.0f} ms" for k in stages if r[k])
        lines.append(f"  {r['id']}: {sum(r[k] or 0 for k in stages):.0f} ms ({parts or 'nothing'})")
    return lines

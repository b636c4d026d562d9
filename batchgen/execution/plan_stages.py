"""`batchgen plan` of a staged job: each stage's plan, what earlier stages leave unknown as a range.

The first stage is planned as any run is (its rows, pictures, prompt tokens, lanes, from its
own output when it resumes). A later stage reads answers not made yet, so it is planned on a
stand-in: the job's rows with every earlier stage's value empty. Its prompt tokens then run
from that (times the fewest rows that may reach it) to that plus each earlier answer it
quotes at its stage's max_tokens (times the most); the rows reaching it are a range once an
earlier stage has a keep_if (none to all), else the rows before it less those that fail.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import ConfigError
from ..core.settings import RunConfig, Stage
from ..input.read import iter_rows
from ..input.source import Source, resolve
from ..input.template import template_fields
from ..output.run_files import stage_output
from .plan import PlanReport, plan_job

__all__ = ["StagePlan", "StagedPlan", "plan_stages"]


@dataclass(slots=True)
class StagePlan:
    """One stage's share of the job: its plan (a later stage's on the stand-in job) and the
    ranges the stages before it leave open."""

    name: str
    report: PlanReport
    rows: tuple[int, int]  # rows the stage runs: fewest, most
    prompt_tokens: tuple[int, int]
    completion_tokens: int  # at most: its rows at max_tokens (none when it only scores)

    def lines(self, number: int) -> list[str]:
        (lo, hi), (p_lo, p_hi) = self.rows, self.prompt_tokens
        rows = f"{lo:,} rows" if lo == hi else f"{lo:,} to {hi:,} rows (the keep_if rules decide)"
        tokens = f"{p_lo:,}" if p_lo == p_hi else f"{p_lo:,} to {p_hi:,}"
        head = [
            f"stage {number} {self.name}: {rows}; prompt tokens {tokens}, "
            f"completion tokens up to {self.completion_tokens:,}"
        ]
        if number > 1:
            head.append("  planned on the job's rows with the earlier stages' answers left empty:")
        return head + [f"  {line}" for line in self.report.lines()]


@dataclass(slots=True)
class StagedPlan:
    """The plans of a staged job's stages, and their tokens in all."""

    stages: list[StagePlan]

    def lines(self) -> list[str]:
        out = [line for number, s in enumerate(self.stages, 1) for line in s.lines(number)]
        lo, hi = (sum(s.prompt_tokens[i] for s in self.stages) for i in (0, 1))
        most = sum(s.completion_tokens for s in self.stages)
        out.append(f"all stages: prompt tokens {lo:,} to {hi:,}, completion tokens up to {most:,}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "stages": [
                {
                    "name": s.name,
                    "rows": list(s.rows),
                    "prompt_tokens": list(s.prompt_tokens),
                    "completion_tokens": s.completion_tokens,
                    "plan": s.report.to_json(),
                }
                for s in self.stages
            ]
        }


def plan_stages(config: RunConfig, calibrate: int = 0) -> StagedPlan:
    """Every stage's plan, changing nothing on disk (the stand-in jobs live in a temporary
    folder). The first stage's rows to do are its own (it resumes from its output); a later
    stage is planned as if it had done none."""
    if calibrate:
        raise ConfigError("--calibrate plans one-stage jobs; a staged job's stages are planned without it")
    if isinstance(config.output, str) or isinstance(config.input, str):
        raise ConfigError("a staged job reads a local job file and writes one local Parquet file")
    first = config.stages[0]
    own = dataclasses.replace(first.config, stages=(), output=stage_output(config.output, 1, first.name))
    report = plan_job(dataclasses.replace(own, input=config.input))
    failing = sum(report.failing.values())  # rows that fail before generating fail here, at the first stage
    plans = [_stage_plan(first, report, (report.todo - failing,) * 2, 0)]
    reaching = _reaching((report.job_rows - failing,) * 2, first)
    source = resolve(config.input, first.config.format)  # scanned and checked by the first stage's plan
    with tempfile.TemporaryDirectory(prefix="batchgen-plan-") as tmp:
        for number, stage in enumerate(config.stages[1:], 2):
            before = config.stages[: number - 1]
            job = _stand_in(source, first.config.columns.id, before, stage, Path(tmp) / f"{number}.parquet")
            stand_in = dataclasses.replace(
                stage.config,
                stages=(),
                input=job,
                output=Path(tmp) / f"{number}-out.parquet",
                paths_from=source.base,
                columns=dataclasses.replace(stage.config.columns, id=None),
            )
            report = plan_job(stand_in)
            plans.append(_stage_plan(stage, report, reaching, _quoted(stage, before)))
            reaching = _reaching(reaching, stage)
    return StagedPlan(plans)


def _stage_plan(stage: Stage, report: PlanReport, rows: tuple[int, int], quoted: int) -> StagePlan:
    """A stage's figures over the rows that may reach it: its prompt tokens per row as planned
    (plus, at most, the earlier answers it quotes), its completions at max_tokens."""
    planned = report.todo - sum(report.failing.values())
    per_row = report.prompt_tokens / planned if planned > 0 else 0.0
    tokens = (round(per_row * rows[0]), round((per_row + quoted) * rows[1]))
    params = stage.config.defaults
    return StagePlan(
        stage.name, report, rows, tokens, 0 if params.score_only else rows[1] * params.max_tokens
    )


def _reaching(rows: tuple[int, int], stage: Stage) -> tuple[int, int]:
    """The rows that may go on after a stage: those that reached it; with a keep_if, from none
    of them to all."""
    return (0 if stage.keep_if is not None else rows[0], rows[1])


def _stand_in(
    source: Source, id_column: str | None, before: tuple[Stage, ...], stage: Stage, path: Path
) -> Path:
    """The job a later stage would read, its earlier stages' values empty: each job row with
    every field its template names from an earlier stage."""
    names = {s.name for s in before}
    fields = [f for f in template_fields(stage.config.prompt_template or "") if f.split(".", 1)[0] in names]
    rows = [
        {**(raw.value if isinstance(raw.value, dict) else {}), **dict.fromkeys(fields, ""), "id": raw.id}
        for raw in iter_rows(source, id_column=id_column)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _quoted(stage: Stage, before: tuple[Stage, ...]) -> int:
    """The most tokens the earlier answers a stage's template quotes may add to its prompt:
    each quoted answer at its stage's max_tokens (a score, a number: a few tokens)."""
    limits = {s.name: 8 if s.config.defaults.score_only else s.config.defaults.max_tokens for s in before}
    fields = template_fields(stage.config.prompt_template or "")
    return sum(limits.get(f.split(".", 1)[0], 0) for f in fields)

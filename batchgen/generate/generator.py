"""The generation seam: a window of rows whose media resolved in, each row's outcome out.

An executor (the local one, or the one inside each Ray actor) makes its `Generator` through a
factory it is given — `Generator` itself, or in tests a scripted one (tests/fakes.py) — and
hands it windows of rows. The generator plans them onto lanes (router.py), runs them in
scheduled batches, joins a row's n completions, times each row, and judges a constrained
answer against its constraint; its figures come back as one `GenerationStats`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..core.constraints import satisfied
from ..core.errors import RowError
from ..core.figures import CacheStats, MemoryStats
from ..core.records import Generation, Job, Media
from ..core.settings import GenerationSettings
from .base.aside import PlanAtHome, aside
from .base.models import ModelInfo
from .lanes.batched import completions
from .router import Plan, Router
from .schedule import schedule

__all__ = ["Generator", "GeneratorFactory", "Resident", "Generated", "GenerationStats", "Planned", "RowPlan"]

log = logging.getLogger(__name__)

# How a failed constraint is named in a row's error.
_CONSTRAINT_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "tool_call": "tool_choice"}


@dataclass(slots=True, kw_only=True)
class GenerationStats:
    """What generation did so far: prefix reuse, rows whose max_tokens was capped at the
    model's context, rows that could not batch (by reason), the memory budget's figures."""

    cache: CacheStats | None = None  # None: no prefix cache (--no-cache)
    max_tokens_capped: int = 0
    one_at_a_time: dict[str, int] = field(default_factory=dict)
    memory: MemoryStats = field(default_factory=MemoryStats)
    adapter_switches: int = 0  # times the model's adapter was changed for the next rows
    model_loads: int = 0  # checkpoints loaded (an engine each)
    planned_aside: int = 0  # rows planned on a thread beside generation


@dataclass(slots=True, kw_only=True)
class Generated:
    """One row of a window through generation.

    Args:
        index: the row's place in the window given to `Generator.plan`.
        generation: what the engine made of it (the first completion, every completion's
            tokens counted); None when it failed without an answer.
        error: the row's error: alone, it failed (planning, the engine, the row deadline);
            beside a generation, its answer misses its constraint (the answer is kept).
        model: the checkpoint that generated (or would have generated) the row.
        adapter: the adapter folder the row ran with (None: the model as it is), and
            `adapter_sha256` its content as the model took it.
        generate_ms: planning, or the row's share of its lane's time.
        choices: n > 1: every completion, as JSON.
        parsed: a JSON-constrained answer, parsed and checked, as JSON text.
    """

    index: int
    generation: Generation | None
    error: RowError | None = None
    model: str | None = None
    generate_ms: float = 0.0
    choices: str | None = None
    parsed: str | None = None
    adapter: str | None = None
    adapter_sha256: str | None = None


@dataclass(slots=True, kw_only=True)
class RowPlan:
    """A row planned: a plan per completion, or the error that stops it; and the time it took."""

    plans: list[Plan]
    error: RowError | None
    ms: float


@dataclass(slots=True)
class Planned:
    """A window's rows on their lanes: a plan per completion, the row each plan is for, and the
    rows that could not be planned (a template that rejects them, media the model cannot take)."""

    rows: list[Job]
    plans: list[Plan] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    failed: list[Generated] = field(default_factory=list)


class Generator:
    """Rows in, `Generated` out, over the run's models and lanes. `stop` ends a batch between
    decode steps (StopRequested); `lazy` inspects and plans without reading weights (`plan`)."""

    def __init__(
        self,
        settings: GenerationSettings,
        stop: threading.Event,
        router: Router | None = None,
        lazy: bool = False,
    ):
        self.settings = settings
        self.router = router if router is not None else Router.from_settings(settings, stop, lazy)
        self.planned_aside = 0

    @property
    def vision_info(self) -> ModelInfo:
        """The media model's facts the media stage bounds frames by (audio, pixels)."""
        return self.router.vision_info

    def load(self, vision: bool, text: bool) -> None:
        """Load what the first rows need, so it overlaps their downloads."""
        self.router.load(vision, text)

    def close(self) -> None:
        """The run is done with this model: its weights and snapshots let go (Router.release)."""
        self.router.release()

    def load_drafter(self) -> None:
        """A drafter that cannot pair with its target stops the run here, before any row."""
        self.router.load_drafter()

    def model_for(self, job: Job) -> str:
        return self.router.model_for(job)

    def prompt_tokens(self, plan: Plan) -> int:
        """The prompt's tokens as the row's generation will count them (media slots expanded)."""
        return self.router.prompt_tokens(plan)

    def media_token_ids(self) -> set[int]:
        """The token ids that stand for image and video patches in the vision model's prompts."""
        config = self.router.models.vlm()[0].config
        names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
        return {v for n in names if isinstance(v := getattr(config, n, None), int)}

    def plan_row(self, job: Job, media: Media) -> RowPlan:
        """The row routed and tokenized, as many plans as it asks completions, or its error."""
        t0 = time.perf_counter()
        try:
            plans, error = completions(self.router.plan(job, media)), None
        except RowError as e:
            plans, error = [], e
        return RowPlan(plans=plans, error=error, ms=(time.perf_counter() - t0) * 1000)

    def plan_aside(self, job: Job, media: Media) -> RowPlan | None:
        """The row planned on a thread beside generation (aside.py); None: only the generating
        thread can plan it (a model to load, a memory to measure), so it is planned there."""
        with aside():
            try:
                planned = self.plan_row(job, media)
            except PlanAtHome:
                return None
        self.planned_aside += 1
        return planned

    def plan(self, rows: list[tuple[Job, Media]], made: list[RowPlan | None] | None = None) -> Planned:
        """Each row's plans: `made[w]` where row w was planned aside, else planned here."""
        planned = Planned([job for job, _ in rows])
        for w, (job, media) in enumerate(rows):
            row = made[w] if made is not None else None
            if row is None:
                row = self.plan_row(job, media)
            if row.error is not None:
                model = self.model_for(job)
                planned.failed.append(
                    Generated(index=w, generation=None, error=row.error, model=model, generate_ms=row.ms)
                )
                continue
            planned.plans += row.plans
            planned.owners += [w] * len(row.plans)
        return planned

    def run(self, planned: Planned) -> Iterator[list[Generated]]:
        """The planned rows' outcomes, a list at a time as they finish (`batch_size` at most).
        Continuous: a lane's rows are one run, a finished row's slot going to the next waiting
        row; else static batches. A batched row's `generate_ms` is its share of the lane's
        time (since the run's previous row finished); a row of n completions comes out once,
        when all n are done."""
        width, plans = self.settings.batch_size, planned.plans
        got: dict[int, list[tuple[int, Generation | RowError]]] = {}
        spent: dict[int, float] = {}
        for run in schedule(plans, None if self.settings.continuous else width, self.router.applied):
            done: list[Generated] = []
            last = started = time.perf_counter()
            tokens = 0
            for i, outcome in self.router.run([plans[p] for p in run], width):
                now, w = time.perf_counter(), planned.owners[run[i]]
                outcomes = got.setdefault(w, [])
                outcomes.append((run[i], outcome))
                spent[w] = spent.get(w, 0.0) + (now - last) * 1000
                last = now
                job = planned.rows[w]
                if len(outcomes) < job.params.completions:
                    continue
                del got[w]
                row = self._judged(w, job, [o for _, o in sorted(outcomes, key=lambda x: x[0])], spent.pop(w))
                row.adapter = plans[run[i]].adapter
                row.adapter_sha256 = self.router.models.digests.get(row.adapter) if row.adapter else None
                tokens += row.generation.completion_tokens if row.generation is not None else 0
                done.append(row)
                if len(done) >= width:
                    yield done
                    done = []
            if log.isEnabledFor(logging.DEBUG):
                lane = plans[run[0]].lane.name if run else "-"
                log.debug(
                    "lane %s: %d rows, %d completion tokens in %.1f s",
                    lane,
                    len(run),
                    tokens,
                    time.perf_counter() - started,
                )
            if done:
                yield done

    def _judged(self, w: int, job: Job, outcomes: list[Generation | RowError], ms: float) -> Generated:
        """A row's completions as one outcome, its answer judged against its constraint: never
        an answer that misses it marked ok."""
        model = self.model_for(job)
        first = _joined(outcomes)
        if isinstance(first, RowError):
            return Generated(index=w, generation=None, error=first, model=model, generate_ms=ms)
        choices = _choices(outcomes) if len(outcomes) > 1 else None
        row = Generated(index=w, generation=first, model=model, generate_ms=ms, choices=choices)
        constraint = job.params.constraint
        if constraint is None:
            return row
        try:
            row.parsed, why = satisfied(constraint, first.text, first.tool_calls)
        except Exception as e:  # noqa: BLE001 - a hostile constraint fails its row, never the run
            row.parsed, why = None, f"could not be checked ({type(e).__name__})"
        if why:
            cut = f" within max_tokens {job.params.max_tokens}" if first.finish_reason == "length" else ""
            what = _CONSTRAINT_NAMES.get(constraint.kind, constraint.kind)
            because = f"(finish_reason {first.finish_reason})"
            row.error = RowError(
                "generate", f"the output {why}: it does not satisfy its {what}{cut} {because}"
            )
        return row

    def stats(self) -> GenerationStats:
        r = self.router
        memory = r.memory.stats if r.memory is not None else MemoryStats()
        return GenerationStats(
            cache=r.prefixes.stats() if r.prefixes is not None else None,
            max_tokens_capped=r.capped,
            one_at_a_time=dict(r.one_at_a_time),
            memory=dataclasses.replace(memory, widths=dict(memory.widths)),
            adapter_switches=r.adapter_switches,
            model_loads=r.model_loads,
            planned_aside=self.planned_aside,
        )


# How an executor makes its generator: `Generator` itself, or a test's scripted one.
GeneratorFactory = Callable[[GenerationSettings, threading.Event], Generator]


class Resident:
    """A generator factory for runs one after another in one process (`batchgen serve`'s
    batches): the models load in the first run and stay for the next while the settings are
    the same (other settings: the old models go, new ones load). `close()` lets them go."""

    def __init__(self) -> None:
        self._router: Router | None = None
        self._settings: GenerationSettings | None = None

    def __call__(self, settings: GenerationSettings, stop: threading.Event) -> Generator:
        if self._router is not None and settings == self._settings:
            self._router.restart(stop)
        else:
            self.close()
            self._router, self._settings = Router.from_settings(settings, stop), settings
        return _Staying(settings, stop, self._router)

    def close(self) -> None:
        if self._router is not None:
            self._router.release()
        self._router = self._settings = None


class _Staying(Generator):
    """A run's generator over a Resident's router: the run's end keeps the models."""

    def close(self) -> None:
        pass


def _joined(outcomes: list[Generation | RowError]) -> Generation | RowError:
    """A row's n completions (OpenAI's `n`) as one: the first's text, all tokens counted; any
    failure fails the row."""
    if len(outcomes) == 1:
        return outcomes[0]
    gens = [o for o in outcomes if isinstance(o, Generation)]
    if len(gens) < len(outcomes):
        return next(o for o in outcomes if isinstance(o, RowError))
    return dataclasses.replace(
        gens[0],
        completion_tokens=sum(g.completion_tokens for g in gens),
        reasoning_tokens=sum(g.reasoning_tokens for g in gens),
        mtp_drafts=sum(g.mtp_drafts for g in gens),
        mtp_accepted=sum(g.mtp_accepted for g in gens),
        capped=any(g.capped for g in gens),
    )


def _choices(gens: list[Generation | RowError]) -> str:
    """Every completion of a row, as the `choices` column's JSON."""
    return json.dumps(
        [
            {
                "text": g.text,
                "finish_reason": g.finish_reason,
                "completion_tokens": g.completion_tokens,
                **({"reasoning": g.reasoning} if g.reasoning is not None else {}),
                **({"tool_calls": g.tool_calls} if g.tool_calls else {}),
                **({"logprobs": g.logprobs} if g.logprobs is not None else {}),
            }
            for g in gens
            if isinstance(g, Generation)
        ]
    )

"""A scripted generator (as datatrove's tests pick a dummy server): tests of the runner, resume,
writes, shards and stops that do not test generation plug it in by argument —
`batchgen.run(config, generator=scripted_generator)`, or the command line's
`main(obj=Seams(generator=...))`, which the `scripted` fixture has `run_cli` pass — and run
without loading or even inspecting a model. Only the router is scripted: the Generator around
it (completions joined, rows timed, constraints judged) is batchgen's own. Every end-to-end and
lane test keeps the real tiny checkpoints."""

from __future__ import annotations

import threading
from contextvars import ContextVar
from pathlib import Path

import pytest

from batchgen.core.errors import RowError
from batchgen.core.records import Generation
from batchgen.core.settings import GenerationSettings
from batchgen.generate.base.models import ModelInfo
from batchgen.generate.base.watch import Watch
from batchgen.generate.generator import Generator, GeneratorFactory
from batchgen.generate.lanes.batched import Lane, Plan

INFO = ModelInfo("scripted", Path("scripted"), vision=True, audio=False, video=False, context=4096)


def answer(job) -> str:
    """What the scripted model answers a row: its id, so tests can tell rows apart."""
    return f"scripted answer to {job.id}"


class ScriptedLane(Lane):
    """Answers every row at once with `answer(job)`; a row whose `script` column says `fail`
    is a generate error. A stop request ends it between rows, as the decoder's steps do."""

    name = "scripted"

    def __init__(self):
        super().__init__(None, INFO)  # type: ignore[arg-type] - no models behind a script

    def plan(self, job, media) -> Plan:
        return Plan(job, media, self)

    def run(self, plans, watch, width):
        for i, plan in enumerate(plans):
            watch.check_stop()
            if plan.job.raw.get("script") == "fail":
                yield i, RowError("generate", "scripted failure")
                continue
            text = answer(plan.job)
            yield (
                i,
                Generation(
                    text=text, finish_reason="stop", prompt_tokens=5, completion_tokens=len(text.split())
                ),
            )


class ScriptedRouter:
    """The router's side of the Generator, scripted: nothing is loaded or inspected, and every
    row goes to the scripted lane."""

    vision_info = text_info = INFO
    prefixes = memory = applied = None

    def __init__(self, stop: threading.Event):
        self.stop, self.lane = stop, ScriptedLane()
        self.capped, self.one_at_a_time, self.adapter_switches, self.model_loads = 0, {}, 0, 1

    def load(self, vision: bool, text: bool) -> None:
        pass

    def load_drafter(self) -> None:
        pass

    def release(self) -> None:
        pass

    def model_for(self, job) -> str:
        return INFO.name

    def plan(self, job, media) -> Plan:
        return self.lane.plan(job, media)

    def run(self, plans, width):
        yield from self.lane.run(plans, Watch(self.stop), width)


def scripted_generator(settings: GenerationSettings, stop: threading.Event) -> Generator:
    """A GeneratorFactory: batchgen's Generator over the scripted router."""
    return Generator(settings, stop, router=ScriptedRouter(stop))  # type: ignore[arg-type]


# The generator factory `run_cli` gives the command line in this test (None: batchgen's own).
plugged: ContextVar[GeneratorFactory | None] = ContextVar("plugged", default=None)


@pytest.fixture
def scripted():
    """Runs in this test generate with the scripted generator (`fakes.answer` says what)."""
    token = plugged.set(scripted_generator)
    yield scripted_generator
    plugged.reset(token)

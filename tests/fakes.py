"""A scripted generator behind the lane interface (as datatrove's dummy server): tests of the
runner, resume, writes, shards and stops that do not test generation run without loading or
even inspecting a model. Every end-to-end and lane test keeps the real tiny checkpoints."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import batchgen.execution.runner
from batchgen.core.errors import RowError
from batchgen.core.records import Generation
from batchgen.generate.lanes import Lane, Plan
from batchgen.generate.models import ModelInfo
from batchgen.generate.router import Engines

INFO = ModelInfo("scripted", Path("scripted"), vision=True, audio=False, video=False, context=4096)


def answer(job) -> str:
    """What the scripted model answers a row: its id, so tests can tell rows apart."""
    return f"scripted answer to {job.id}"


class ScriptedLane(Lane):
    """Answers every row at once with `answer(job)`; a row whose `script` column says `fail`
    is a generate error. A stop request ends it between rows, as the decoder's steps do."""

    name = "scripted"

    def plan(self, job, media) -> Plan:
        return Plan(job, media, self)

    def run(self, plans, watch, width):
        for i, plan in enumerate(plans):
            watch.check_stop()
            if plan.job.raw.get("script") == "fail":
                yield i, RowError("generate", "scripted failure")
                continue
            text = answer(plan.job)
            yield i, Generation(text, "stop", prompt_tokens=5, completion_tokens=len(text.split()))


class ScriptedEngines(Engines):
    """The router's interface over the scripted lane: nothing is loaded or inspected."""

    def __init__(self, *args, **kwargs):
        self.vision_info = self.text_info = INFO
        self.prefixes, self.row_timeout, self.memory = None, None, None
        self.stop = threading.Event()
        self.capped, self.one_at_a_time = 0, {}
        self.lane = ScriptedLane(None, INFO)  # type: ignore[arg-type]

    def load(self, vision: bool, text: bool) -> None:
        pass

    def load_drafter(self) -> None:
        pass

    def model_for(self, job) -> str:
        return INFO.name

    def route(self, job, media):
        return self.lane


@pytest.fixture
def scripted(monkeypatch):
    """Runs in this test generate with the scripted lane (`fakes.answer` says what)."""
    monkeypatch.setattr(batchgen.execution.runner, "Engines", ScriptedEngines)

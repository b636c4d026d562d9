"""The rows after this window, planned beside its generation.

While a window decodes, a thread plans the rows the media look-ahead holds for the next one
(`Generator.plan_aside`): the chat template, the tokenizer and the processor's work run on
the other core instead of between windows. Windows are taken as before — the same rows, in
the same order, planned the same way — so outputs do not depend on it. A row the thread has
not started when its window is taken, or hands back (a model to load: generate/base/aside.py), is
planned by the generating thread. The two never plan at once.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future, wait

from ..core.records import Job, Media
from ..generate.generator import Generator, Planned, RowPlan
from ..media.resolve import Prefetcher, Prepared

__all__ = ["AsidePlanner"]

_POLL = 0.1  # seconds between looks at the stop while a row's media resolve


class AsidePlanner:
    """Plans the look-ahead's rows on a thread of its own; `plan` plans a window taken from it."""

    def __init__(self, generator: Generator, prefetcher: Prefetcher, stop: threading.Event):
        self.generator, self.prefetcher, self.stop = generator, prefetcher, stop
        # Rows offered and not yet taken, in job order: each with its plan to come.
        self._offered: deque[tuple[Job, Future[RowPlan | None]]] = deque()
        self._todo: queue.SimpleQueue[tuple[Job, Future | None, Future[RowPlan | None]] | None]
        self._todo = queue.SimpleQueue()
        self._closed = threading.Event()
        self._planning = threading.Lock()  # held by whichever thread plans
        self._thread = threading.Thread(target=self._work, name="batchgen-plan", daemon=True)
        self._thread.start()

    def offer(self) -> None:
        """The look-ahead's rows not offered before go to the thread."""
        ahead = list(self.prefetcher.ahead)
        for job, media in ahead[len(self._offered) :]:
            plan: Future[RowPlan | None] = Future()
            self._offered.append((job, plan))
            self._todo.put((job, media, plan))

    def plan(
        self, window: list[tuple[Job, Prepared | None]], todo: list[int], rows: list[tuple[Job, Media]]
    ) -> Planned:
        """The window's `rows` (its rows at `todo`) planned: aside where the thread got to them,
        here otherwise; then the rows after the window go to the thread while these run."""
        with self._planning:  # the thread is between rows: no row is half planned aside
            made = self._claim(window)
            planned = self.generator.plan(rows, [made[w] for w in todo])
        self.offer()
        return planned

    def _claim(self, window: list[tuple[Job, Prepared | None]]) -> list[RowPlan | None]:
        """What was planned aside for each row of the window (None: plan it here): taken while
        the thread waits, so a row is planned aside already or not at all."""
        made: list[RowPlan | None] = []
        for job, _ in window:
            if not self._offered or self._offered[0][0] is not job:
                made.append(None)  # queued into the look-ahead and taken in the same window
                continue
            _, plan = self._offered.popleft()
            made.append(None if plan.cancel() else plan.result())  # cancelled, or done
        return made

    def close(self) -> None:
        """No more rows: the thread ends after the row it is planning (if any)."""
        self._closed.set()
        for _, plan in self._offered:
            plan.cancel()
        self._offered.clear()
        self._todo.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            job, media, plan = item
            if not self._resolved(media, plan):
                continue
            with self._planning:
                if plan.set_running_or_notify_cancel():
                    self._plan(job, media, plan)

    def _plan(self, job: Job, media: Future | None, plan: Future[RowPlan | None]) -> None:
        try:
            prepared: Prepared | None = media.result() if media is not None else None
            if job.error or (prepared is not None and prepared.error):
                plan.set_result(None)  # the row fails before generation: nothing to plan
            else:
                plan.set_result(self.generator.plan_aside(job, prepared.media if prepared else Media()))
        except BaseException as e:  # noqa: BLE001 - raised where the plan is claimed
            plan.set_exception(e)

    def _resolved(self, media: Future | None, plan: Future) -> bool:
        """The row's media are ready (False: its plan was taken back, or the run ends)."""
        while media is not None and not media.done():
            if plan.cancelled() or self._closed.is_set() or self.stop.is_set():
                return False
            wait([media], timeout=_POLL)
        return not (self._closed.is_set() or self.stop.is_set())

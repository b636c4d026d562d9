"""A job whose rows name several models: a pass per model, one model in memory at a time."""

from __future__ import annotations

import logging

from ..core.errors import plural
from ..core.settings import RunConfig, WorkSettings, work_settings
from ..input.parse import parse_job
from ..input.read import id_key
from ..output.pending import Pending
from .executor import Batches, Executor, ExecutorStats
from .local import LocalExecutor
from .ray import RayExecutor

__all__ = ["ModelPasses", "executor_for", "one_model"]

log = logging.getLogger(__name__)


class ModelPasses(Executor):
    """The pending rows split by the model they name, then run a model at a time: a pass is an
    executor of the run's kind (`kind`) made for one model, over the pending rows with the
    other models' rows counted done for it; the one before it is closed (its weights let go)
    first. Rows naming no model, a model not in the set, or that cannot be read go with
    `--model`'s pass, whose generator says what is wrong with them. Every model is inspected
    here, before any work: a path that is no model stops the run now."""

    def _start(self) -> None:
        self.kind = one_model(self.config)
        self.configs = self.config.per_model()
        self.done: list[ExecutorStats] = []  # the figures of the passes run so far
        self.current: Executor | None = self._executor(0)
        for later in self.configs[1:]:
            self.make_generator(self._work(later).generation, self.stop)  # inspected, nothing loaded

    def _work(self, config: RunConfig) -> WorkSettings:
        base = self.work.base_dir
        return work_settings(config, str(base) if base is not None else None)

    def _executor(self, i: int) -> Executor:
        config = self.configs[i]
        return self.kind(config, self._work(config), self.tmp_dir, self.stop, self.make_generator)

    def run(self, todo: Pending) -> Batches:
        owners = self._owners(todo)
        for i, config in enumerate(self.configs):
            others: dict[str, str | None] = {key: None for key in todo.keys() if owners.get(key, 0) != i}
            mine = sum(1 for _ in todo.keys()) - len(others)
            if not mine:
                continue
            if i > 0:
                self._close()
                self.current = self._executor(i)
            log.info("model %s: %s", config.model, plural(mine, "row"))
            assert self.current is not None
            yield from self.current.run(Pending(todo.index, todo.done | others, todo.looped))
            if self.stop.is_set():
                return

    def _owners(self, todo: Pending) -> dict[str, int]:
        """The pass of each pending row that names a model of the set other than --model's
        (the rest are the first pass's)."""
        owners: dict[str, int] = {}
        for raw in todo.rows():
            job = parse_job(raw, self.work)
            if job.model is not None and not job.error:
                owner = self.config.model_paths.index(self.config.model_for(job.model))
                if owner:
                    owners[id_key(raw.id)] = owner
        return owners

    def _close(self) -> None:
        if self.current is not None:
            self.done.append(self.current.stats())
            self.current.close()
            self.current = None

    def stats(self) -> ExecutorStats:
        now = [self.current.stats()] if self.current is not None else []
        return ExecutorStats.added([*self.done, *now])

    def close(self) -> None:
        self._close()


def one_model(config: RunConfig) -> type[Executor]:
    """The executor that runs a model's rows: here, or on Ray (--engine)."""
    return RayExecutor if config.executor == "ray" else LocalExecutor


def executor_for(config: RunConfig) -> type[Executor]:
    """The run's executor: a pass per model when rows name several (--models), else one."""
    return ModelPasses if config.models else one_model(config)

"""Planning aside: rows planned on a thread of their own while the generating thread decodes.

MLX streams belong to the thread that made them: an array built lazily on the planning thread
cannot be evaluated by the generating one ("There is no Stream(cpu, N) in current thread").
So a plan made aside holds only evaluated arrays (`settle`), and what leaves lazy state behind
for later rows — loading a model (its modules build arrays on first use), measuring a row's
memory on the model, a graph that runs the vision tower only if a prompt slice needs it — is
done by the generating thread alone: `at_home` hands such a row back, to be planned there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

__all__ = ["PlanAtHome", "aside", "at_home", "planning_aside", "settle"]

_here = threading.local()


class PlanAtHome(Exception):
    """Raised on the planning thread by a step only the generating thread may take: the row is
    planned again there. Raised before the step changes anything."""


@contextmanager
def aside() -> Iterator[None]:
    """This thread plans rows aside while the block runs."""
    _here.aside = True
    try:
        yield
    finally:
        _here.aside = False


def planning_aside() -> bool:
    return getattr(_here, "aside", False)


def at_home(what: str) -> None:
    """`what` must run on the generating thread: refused while planning aside."""
    if planning_aside():
        raise PlanAtHome(what)


def settle(*arrays: mx.array | None) -> None:
    """Arrays a plan keeps, evaluated on the thread that built them when that is the planner's."""
    if planning_aside():
        mx.eval([a for a in arrays if a is not None])

"""The rows a run has to do, in job order, read from the job's files when asked for, never held."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..input.read import JobIndex, RawRow, id_key

__all__ = ["Pending"]


@dataclass(slots=True)
class Pending:
    """The pending rows of `index`: those whose id key is not in `done`."""

    index: JobIndex
    done: dict[str, str | None]
    looped: frozenset[str] = frozenset()  # id keys of rows the loop stop ended, generated again

    def indices(self) -> Iterator[int]:
        """Their row indices in the files."""
        rows = self.index.rows
        for i, row_id in enumerate(rows.ids):
            if id_key(row_id) not in self.done:
                yield rows.position(i)

    def keys(self) -> Iterator[str]:
        """Their id keys."""
        return (key for key in map(id_key, self.index.ids) if key not in self.done)

    def rows(self) -> Iterator[RawRow]:
        """The rows themselves, read from the mark before the first of them (a resumed run
        does not read the finished part of the job again), up to the last row kept."""
        first = next(self.indices(), None)
        if first is None:
            return
        positions = self.index.rows.positions
        kept = set(positions) if positions is not None else None
        last = positions[-1] if positions else -1
        start = self.index.mark_before(first)
        for raw in self.index.read(start):
            if kept is not None and raw.index > last:
                return
            if (kept is None or raw.index in kept) and id_key(raw.id) not in self.done:
                yield raw

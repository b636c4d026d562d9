"""The plan over the whole job: rows sharing a picture or a long prefix brought side by side.

Each row's share key is found by the scan; the pending rows are ordered so rows sharing a
picture or a long prefix sit side by side wherever they stand in the job. A prompt-major job
(every picture with the first question, then every picture with the second) then reuses each
vision pass and prefill as an image-major one does, although its rows meet in no look-ahead
window.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..core.settings import Columns
from .parse import shared_parts
from .read import NO_SHARE, SHARE, JobIndex, RawRow, id_key

__all__ = ["share_keys", "PlanFigures", "Grouping"]

LONG_PREFIX = 200  # characters of text before a row's last turn that make it worth sharing (~50 tokens)
_ROW_BYTES = 120  # a held RawRow itself, beyond its values


def share_keys(columns: Columns) -> Callable[[RawRow], bytes]:
    """The scan's share function: a row's key from its media references in order (path,
    URL, data URL or bytes, by digest), else from its text before the last turn when that
    is long (a system prompt with few-shot turns); NO_SHARE for a row sharing nothing that
    can be known before its media are read (a tar sample's own members, a row that does not
    parse). A --prompt-template only fills the last turn: it changes no key."""

    def key(row: RawRow) -> bytes:
        if row.fingerprint is not None or row.error is not None:
            return NO_SHARE
        try:
            media, head = shared_parts(row.value, columns)
        except Exception:  # noqa: BLE001 - a hostile row shares nothing; its parse names its problem
            return NO_SHARE
        h = hashlib.blake2b(digest_size=SHARE)
        if media:
            for kind, source in media:
                h.update(kind.encode())
                h.update(source if isinstance(source, bytes) else source.encode())
                h.update(b"\0")
        else:
            text = head if isinstance(head, str) else json.dumps(head, sort_keys=True, default=str)
            if head is None or len(text) < LONG_PREFIX:
                return NO_SHARE
            h.update(text.encode())
        digest = h.digest()
        return digest if digest != NO_SHARE else b"\1" + digest[1:]

    return key


@dataclass(slots=True)
class PlanFigures:
    """What the plan found among the pending rows."""

    rows: int  # pending rows
    groups: int  # share keys held by two rows or more
    grouped: int  # rows in those groups
    largest: int  # rows of the largest group

    @property
    def alone(self) -> int:
        return self.rows - self.grouped


class Grouping:
    """The pending rows' groups, by position in the index: `group[p]` is the group of the row
    at position p (-1: it shares nothing with another pending row), `size[g]` its members.
    Built from the scan's share keys with numpy: a few bytes a row."""

    def __init__(self, index: JobIndex, done: Iterable[str] | dict[str, str | None] = ()):
        n = len(index.ids)
        done = done if isinstance(done, (set, dict)) else set(done)
        shares = index.rows.shares
        keys = (
            np.frombuffer(shares, dtype=">u8")  # a view: no copy
            if shares is not None
            else np.zeros(n, dtype=">u8")
        )
        usable = keys != 0
        pending = n
        if done:
            todo = np.fromiter((id_key(i) not in done for i in index.ids), dtype=bool, count=n)
            pending = int(todo.sum())
            usable &= todo
            del todo
        every = bool(usable.all())
        rows = slice(None) if every else np.flatnonzero(usable).astype(np.int32)  # a few bytes a row
        del usable
        _, inverse, counts = np.unique(keys if every else keys[rows], return_inverse=True, return_counts=True)
        shared = counts >= 2
        renumber = (np.cumsum(shared) - 1).astype(np.int32)  # groups of two or more, numbered 0..
        self.group = np.full(n, -1, dtype=np.int32)
        self.group[rows] = np.where(shared[inverse], renumber[inverse], -1)
        del rows, inverse, renumber
        self.size = counts[shared].astype(np.int64)
        self.figures = PlanFigures(
            pending,
            int(shared.sum()),
            int(counts[shared].sum()),
            int(counts.max()) if counts.size else 0,
        )
        positions = index.rows.positions
        self._positions = np.asarray(positions, dtype=np.int64) if positions is not None else None

    def position(self, row_index: int) -> int:
        """Where a row of the file (its index) stands among the index's kept rows."""
        if self._positions is None:
            return row_index
        return int(np.searchsorted(self._positions, row_index))

    def in_groups(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        """(row index, group) of these pending row indices, each group's rows together at its
        first member's place (the Ray driver's items; the indices only, never the rows)."""
        members: dict[int, list[int]] = {}
        order: list[tuple[int, int]] = []
        for i in indices:
            g = int(self.group[self.position(i)])
            if g < 0:
                order.append((i, g))
            elif g not in members:
                members[g] = [i]
                order.append((-1, g))  # the group's place, filled below
            else:
                members[g].append(i)
        return [(i, g) for place, g in order for i in ([place] if g < 0 else members[g])]

    def ordered(self, rows: Iterable[RawRow], horizon: int, chunk: int) -> Iterator[RawRow]:
        """The rows (pending, in job order) with each group's members brought together: a
        member waits until its group's last member is read or `chunk` of them wait (a run of
        rows that large reuses the picture anyway), and the waiting rows hold at most about
        `horizon` bytes: past it the group waiting longest goes as it is, as a window would
        have taken it. Rows sharing nothing pass at once."""
        left = self.size.copy()  # members of each group not read yet
        held: dict[int, list[RawRow]] = {}
        held_bytes = 0
        sizes: dict[int, int] = {}
        for row in rows:
            g = int(self.group[self.position(row.index)])
            if g < 0:
                yield row
                continue
            members = held.setdefault(g, [])
            members.append(row)
            size = _ROW_BYTES + _footprint(row.value)
            sizes[g] = sizes.get(g, 0) + size
            held_bytes += size
            left[g] -= 1
            if left[g] <= 0 or len(members) >= chunk:
                held_bytes -= sizes.pop(g)
                yield from held.pop(g)
            while held_bytes > horizon and held:
                oldest = next(iter(held))
                held_bytes -= sizes.pop(oldest)
                yield from held.pop(oldest)
        for members in held.values():
            yield from members


def _footprint(value: object, depth: int = 0) -> int:
    """About what a row's values hold in memory, as CPython lays them out (a string's 49-byte
    header, a dict's table), a few levels deep: what the hold counts against its horizon."""
    if isinstance(value, str):
        return 49 + len(value)
    if isinstance(value, (bytes, bytearray)):
        return 33 + len(value)
    if depth > 4:
        return 0
    if isinstance(value, dict):
        return 232 + sum(24 + _footprint(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return 56 + sum(8 + _footprint(v, depth + 1) for v in value)
    return 32

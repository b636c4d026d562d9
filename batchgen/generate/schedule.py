"""Schedule stage: order a window of planned rows into batches that share work."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

__all__ = ["Schedulable", "schedule"]


class Schedulable(Protocol):
    @property
    def lane(self) -> Hashable: ...

    @property
    def group(self) -> Hashable: ...

    @property
    def adapter(self) -> str | None: ...

    @property
    def solo(self) -> bool: ...

    @property
    def span(self) -> int: ...  # the most tokens the row's cache may hold: prompt + max_tokens


def schedule(
    rows: Sequence[Schedulable], batch_size: int | None, applied: str | None = None
) -> list[list[int]]:
    """Runs of row indices. Rows of one group (same prompt prefix, same images) run back to
    back so the first one's prefill serves the rest; lanes never mix; solo rows run alone.
    Groups keep the order in which they first appear in the window. A run holds at most
    `batch_size` rows; None: one run per lane (continuous batching refills its slots), its
    groups and each group's rows ordered by span (prompt + max_tokens), largest first
    (stable): the long rows then run beside the short ones that fill the slots they leave,
    instead of on their own at the end, and rows of like lengths share a batch (less padding
    to attend over; under a memory budget, long rows run narrow together and the short ones
    wide after them, where mixed they would hold every slot to the longest's size). Rows of
    different adapters never share a run, and one adapter's runs come one after another (each
    change of adapter is a switch of the model's layers), the one the model carries (`applied`)
    first (None: the model bare, the base's rows first): a window that goes on with the last
    one's adapter switches one time fewer."""
    groups: dict[tuple[Hashable, Hashable], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(((row.lane, row.adapter), row.group), []).append(i)
    if batch_size is None:
        for members in groups.values():
            members.sort(key=lambda i: -rows[i].span)
        groups = dict(sorted(groups.items(), key=lambda g: -rows[g[1][0]].span))
    batches: list[list[int]] = []
    open_batch: dict[Hashable, list[int]] = {}
    for (lane, _), members in groups.items():
        for i in members:
            if rows[i].solo:
                batches.append([i])
                continue
            batch = open_batch.setdefault(lane, [])
            batch.append(i)
            if batch_size is not None and len(batch) >= batch_size:
                batches.append(batch)
                open_batch[lane] = []
    batches += [b for b in open_batch.values() if b]
    order = list(dict.fromkeys([applied, *(rows[b[0]].adapter for b in batches)]))
    return sorted(batches, key=lambda b: order.index(rows[b[0]].adapter))

"""The figures a run reports (media, memory, prefix reuse, rows by model), added up over executors."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MediaStats", "MemoryStats", "CacheStats", "RowGroup", "GROUPED_BY", "MAX_GROUPS"]


@dataclass(slots=True, kw_only=True)
class MediaStats:
    """The media work of a run: downloads and what reuse saved."""

    downloads: int = 0
    download_bytes: int = 0
    download_retries: int = 0
    url_reuses: int = 0  # rows whose URL was downloaded for an earlier row
    media_cache_hits: int = 0  # URLs served from --media-cache
    image_decodes: int = 0
    image_decode_reuses: int = 0
    video_decodes: int = 0
    video_decode_reuses: int = 0

    @classmethod
    def added(cls, parts: list[MediaStats]) -> MediaStats:
        return cls(**{f: sum(getattr(p, f) for p in parts) for f in cls.__slots__})


@dataclass(slots=True, kw_only=True)
class MemoryStats:
    """What the memory budget did in a run (generate/decode/memory.py): its size and how it was found,
    the widths decode steps ran at, out-of-memory failures and the rows they sent back, rows
    too big to run at all."""

    budget: int | None = None  # bytes; None: no budget (--memory-budget off)
    how: str = ""
    weights: int = 0
    ceiling: int | None = None  # bytes a batch may hold, once an out-of-memory lowered it
    out_of_memory: int = 0  # batches an allocation failure split
    retried: int = 0  # rows those batches ran again
    too_big: int = 0  # rows refused before any work: over the budget alone
    widths: dict[int, int] = field(default_factory=dict)  # decode steps at each batch width

    @classmethod
    def added(cls, parts: list[MemoryStats]) -> MemoryStats:
        """Several executors' (Ray actors', each with its own budget): counts add."""
        if not parts:
            return cls()
        widths: dict[int, int] = {}
        for p in parts:
            for w, n in p.widths.items():
                widths[int(w)] = widths.get(int(w), 0) + n
        ceilings = [p.ceiling for p in parts if p.ceiling is not None]
        return cls(
            budget=parts[0].budget,
            how=parts[0].how,
            weights=parts[0].weights,
            ceiling=min(ceilings) if ceilings else None,
            out_of_memory=sum(p.out_of_memory for p in parts),
            retried=sum(p.retried for p in parts),
            too_big=sum(p.too_big for p in parts),
            widths=widths,
        )


@dataclass(slots=True, kw_only=True)
class CacheStats:
    """Prompt-prefix reuse over a run (or several executors' runs, added up)."""

    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_hit_rate: float = 0.0  # hits / lookups
    prefix_evictions: int = 0
    prompt_tokens_saved: int = 0

    @classmethod
    def added(cls, parts: list[CacheStats]) -> CacheStats:
        counts = ("prefix_hits", "prefix_misses", "prefix_evictions", "prompt_tokens_saved")
        total = cls(**{name: sum(getattr(p, name) for p in parts) for name in counts})
        lookups = total.prefix_hits + total.prefix_misses
        total.prefix_hit_rate = round(total.prefix_hits / lookups, 4) if lookups else 0.0
        return total


# The output columns whose values group its rows in the stats (a run of several models or
# adapters: how each one's rows ended), and how many groups of one column are kept.
GROUPED_BY = ("model", "adapter")
MAX_GROUPS = 64


@dataclass(slots=True, kw_only=True)
class RowGroup:
    """The output's rows of one model (or adapter): `value` as the column holds it ("" for none)."""

    value: str
    rows: int
    ok: int

    @property
    def failed(self) -> int:
        return self.rows - self.ok

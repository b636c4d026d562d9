"""A run's budgets as a person writes them: memory (`--memory-budget`) and time (`--time-limit`).

The device's memory is only known where MLX runs (generate/decode/memory.py); this is the part a
settings file or a flag can be checked against before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["BudgetSpec", "budget_spec", "parse_size", "human_bytes", "parse_duration", "human_duration"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_SHARE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """What `--memory-budget` asked for: a size in bytes, a share of the device's memory, or
    (neither) `auto`, the device's own working-set figure."""

    text: str
    size: int | None = None
    share: float | None = None


def parse_size(text: str) -> int:
    """Bytes from `8GB`, `7.5GiB`, `512MiB` or a plain count; k/M/G/T are powers of ten,
    KiB/MiB/GiB/TiB powers of two, as `df -H` and `df -h` print them."""
    m = _SIZE.fullmatch(text) if len(text) <= 32 else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text[:40]!r} is not a size such as 8GB, 7.5GiB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def budget_spec(value: object) -> BudgetSpec | None:
    """The budget a setting names, checked; None (`off`): no budget, --batch-size alone bounds a batch."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in ("off", "none"):
        return None
    if text.lower() == "auto":
        return BudgetSpec("auto")
    share = _SHARE.fullmatch(text) if len(text) <= 16 else None
    if share is not None:
        pct = float(share.group(1))
        if not 0 < pct <= 100:
            raise ConfigError(f"--memory-budget {text!r}: a share must be above 0% and at most 100%")
        return BudgetSpec(text, share=pct / 100)
    try:
        size = parse_size(text)
    except ValueError as e:
        raise ConfigError(f"--memory-budget: {e}; or auto, or a share such as 60%") from e
    if size < 2**20:
        raise ConfigError(f"--memory-budget {text!r}: under 1 MiB; write the unit (8GB, 512MiB)")
    return BudgetSpec(text, size=size)


def human_bytes(n: float) -> str:
    """`7.5 GiB`, `512 MiB`, `900 KiB`: memory as a person reads it in a log line."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


def parse_duration(value: object) -> float:
    """Seconds from `55m`, `2h`, `1h30m`, `90s` or a plain number of seconds (a preset's 3600)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        m = _DURATION.fullmatch(text) if 0 < len(text) <= 32 else None
        if m is None or not any(m.groups()):
            raise ConfigError(f"--time-limit {str(value)[:40]!r}: not a duration such as 55m, 2h or 1h30m")
        hours, minutes, secs = (float(g or 0) for g in m.groups())
        seconds = hours * 3600 + minutes * 60 + secs
    if not seconds > 0:
        raise ConfigError(f"--time-limit {str(value)[:40]!r}: must be more than 0 seconds")
    if not seconds < _LONGEST:
        raise ConfigError(f"--time-limit {str(value)[:40]!r}: must be under {_LONGEST:,} seconds (31 years)")
    return seconds


_LONGEST = 10**9  # a limit past this is a typo; no timer takes it


def human_duration(seconds: float) -> str:
    """`1h05m`, `12m30s`, `45s`: a time span as a log line says it."""
    s = max(int(round(seconds)), 0)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"

"""batchgen: batch inference for text and vision-language models on MLX."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .core.errors import (  # light: the standard library only
    BatchgenError,
    ConfigError,
    FailFastError,
    Interrupted,
    JobFileError,
    OutputLockedError,
    RunFailedError,
)

if TYPE_CHECKING:
    from .core.settings import RunConfig
    from .execution.config import build_config
    from .execution.stages import run
    from .execution.summary import Progress, RunSummary

__all__ = [
    "BatchgenError",
    "ConfigError",
    "JobFileError",
    "OutputLockedError",
    "Interrupted",
    "FailFastError",
    "RunFailedError",
    "RunConfig",
    "RunSummary",
    "Progress",
    "build_config",
    "run",
]
__version__ = "0.1.0"

# Loaded on first use: `batchgen status` and `--help` start without MLX and transformers.
_HOMES = {
    "RunConfig": ".core.settings",
    "build_config": ".execution.config",
    "run": ".execution.stages",
    "RunSummary": ".execution.summary",
    "Progress": ".execution.summary",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name], __name__), name)

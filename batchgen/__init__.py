"""batchgen: batch inference for text and vision-language models on MLX."""

from .core.errors import BatchgenError
from .core.settings import RunConfig, build_config
from .execution.runner import run
from .execution.summary import RunSummary

__all__ = ["BatchgenError", "RunConfig", "RunSummary", "build_config", "run"]
__version__ = "0.1.0"

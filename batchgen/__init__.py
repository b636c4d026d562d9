"""batchgen: batch inference for text and vision-language models on MLX."""

from .config import RunConfig, build_config
from .errors import BatchgenError
from .runner import run
from .summary import RunSummary

__all__ = ["BatchgenError", "RunConfig", "RunSummary", "build_config", "run"]
__version__ = "0.1.0"

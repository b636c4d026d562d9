"""Model inspection: what a checkpoint takes (text, images, video, audio), read from its config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import ConfigError

__all__ = ["ModelInfo", "inspect_model", "weights_path", "is_multimodal", "has_keys"]

_VISION_KEYS = (
    "vision_config",
    "visual",
    "vision_tower",
    "mm_vision_tower",
    "image_token_id",
    "image_token_index",
)
_AUDIO_KEYS = ("audio_config", "audio_tower", "audio_token_id", "audio_token_index")
_VIDEO_KEYS = ("video_token_id", "video_token_index")
_VLM_NAME_HINTS = (
    "-vl",
    "vl-",
    "llava",
    "idefics",
    "paligemma",
    "gemma-3",
    "pixtral",
    "molmo",
    "phi-3-vision",
    "internvl",
    "minicpm-v",
    "florence",
    "deepseek-vl",
)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the checkpoint's config says it can take."""

    name: str
    path: Path
    vision: bool
    audio: bool
    video: bool  # frames go in as a video (temporal grid) rather than as images
    context: int | None = None  # max_position_embeddings, where the config says
    max_pixels: int | None = None  # most pixels per image/frame its processor keeps, where it says
    head_dim: int | None = None  # the language model's attention head size, where the config says

    @property
    def multimodal(self) -> bool:
        return self.vision or self.audio


def has_keys(config: dict[str, Any], keys: tuple[str, ...]) -> bool:
    return any(config.get(k) not in (None, {}, []) for k in keys)


def is_multimodal(config: dict[str, Any], name: str = "") -> bool:
    """From the config's towers; the name is only a fallback for configs that hide them."""
    if has_keys(config, _VISION_KEYS) or has_keys(config, _AUDIO_KEYS):
        return True
    lowered = name.lower()
    return any(hint in lowered for hint in _VLM_NAME_HINTS)


# A hub checkpoint's files that say what it is (config, processor, tokenizer, chat template):
# mlx-vlm's download patterns less the weights, which only loading it needs.
_DESCRIBED_BY = ["*.json", "*.jsonl", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _model_path(name: str, weights: bool = False) -> Path:
    """The checkpoint's local folder: a folder as given, else the hub snapshot of `name` with
    the files that describe it, and its weights too where they will be loaded (a Ray driver or
    a plan that reads no weights downloads none)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")):
        raise ConfigError(f"model {name!r}: not a checkpoint folder")
    try:
        from mlx_vlm.utils import get_model_path

        return Path(get_model_path(name, allow_patterns=None if weights else _DESCRIBED_BY))
    except Exception as e:  # hub errors come in many types
        raise ConfigError(f"model {name!r}: cannot find it locally or on the hub ({e})") from e


def weights_path(info: ModelInfo) -> str:
    """Where the checkpoint's weights are, downloaded first when it came from the hub (its
    inspection fetched only what describes it)."""
    return str(_model_path(info.name, weights=True))


def inspect_model(name: str) -> ModelInfo:
    """Read the checkpoint's config.json; a missing or broken one stops the run before it starts."""
    path = _model_path(name)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {name!r}: cannot read {path / 'config.json'} ({e})") from e
    audio = has_keys(config, _AUDIO_KEYS)
    vision = has_keys(config, _VISION_KEYS) or (not audio and is_multimodal(config, name))
    text = config.get("text_config") or {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return ModelInfo(
        name,
        path,
        vision=vision,
        audio=audio,
        video=vision and has_keys(config, _VIDEO_KEYS),
        context=context,
        max_pixels=_processor_pixels(path),
        head_dim=_head_dim(text or config),
    )


def _head_dim(config: dict[str, Any]) -> int | None:
    """`head_dim`, else hidden size over heads (the two ways configs say it)."""
    dim, hidden, heads = (config.get(k) for k in ("head_dim", "hidden_size", "num_attention_heads"))
    if isinstance(dim, int) and dim > 0:
        return dim
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _processor_pixels(path: Path) -> int | None:
    """The most pixels the processor keeps per frame: video settings first, then image ones
    (`max_pixels`, a `longest_edge`, or a fixed height x width)."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        try:
            config = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        size = config.get("size") if isinstance(config.get("size"), dict) else {}
        for value in (config.get("max_pixels"), size.get("max_pixels")):
            if isinstance(value, int) and value > 0:
                return value
        edge = size.get("longest_edge")
        if isinstance(edge, int) and edge > 0:
            return edge * edge
        if isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
            return max(1, size["height"] * size["width"])
    return None

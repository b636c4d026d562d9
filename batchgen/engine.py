"""Generate stage: the one module that talks to MLX (mlx-lm for text rows, mlx-vlm for media)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, RowError
from .records import Generation, GenParams, Job

__all__ = ["ModelInfo", "Media", "Engines", "inspect_model", "is_multimodal"]

log = logging.getLogger(__name__)

END_OF_TURN = "<|im_end|>"  # Qwen-style templates end a turn here even when eos differs
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
    "-vl", "vl-", "llava", "idefics", "paligemma", "gemma-3", "pixtral", "molmo",
    "phi-3-vision", "internvl", "minicpm-v", "florence", "deepseek-vl",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the checkpoint's config says it can take."""

    name: str
    path: Path
    vision: bool
    audio: bool
    video: bool  # frames go in as a video (temporal grid) rather than as images

    @property
    def multimodal(self) -> bool:
        return self.vision or self.audio


@dataclass(slots=True)
class Media:
    """A row's decoded media, in part order per kind."""

    images: list[Any] = field(default_factory=list)  # PIL images
    videos: list[Any] = field(default_factory=list)  # (T, H, W, 3) uint8 arrays
    audio: list[str] = field(default_factory=list)  # local file paths

    def __bool__(self) -> bool:
        return bool(self.images or self.videos or self.audio)


def _has(config: dict[str, Any], keys: tuple[str, ...]) -> bool:
    return any(config.get(k) not in (None, {}, []) for k in keys)


def is_multimodal(config: dict[str, Any], name: str = "") -> bool:
    """From the config's towers; the name is only a fallback for configs that hide them."""
    if _has(config, _VISION_KEYS) or _has(config, _AUDIO_KEYS):
        return True
    lowered = name.lower()
    return any(hint in lowered for hint in _VLM_NAME_HINTS)


def _model_path(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")):
        raise ConfigError(f"model {name!r}: not a checkpoint folder")
    try:
        from mlx_vlm.utils import get_model_path

        return Path(get_model_path(name))
    except Exception as e:  # hub errors come in many types
        raise ConfigError(f"model {name!r}: cannot find it locally or on the hub ({e})") from e


def inspect_model(name: str) -> ModelInfo:
    """Read the checkpoint's config.json; a missing or broken one stops the run before it starts."""
    path = _model_path(name)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {name!r}: cannot read {path / 'config.json'} ({e})") from e
    audio = _has(config, _AUDIO_KEYS)
    vision = _has(config, _VISION_KEYS) or (not audio and is_multimodal(config, name))
    return ModelInfo(name, path, vision=vision, audio=audio, video=vision and _has(config, _VIDEO_KEYS))


def _apply_template(template_owner: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    from mlx_vlm.prompt_utils import get_chat_template

    try:
        return get_chat_template(template_owner, messages, True, **kwargs)
    except Exception:
        if not kwargs:
            raise
        # A template that rejects an extra keyword still renders without it.
        return get_chat_template(template_owner, messages, True)


def _text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = "".join(p["text"] for p in content if p["type"] == "text")
        out.append({"role": m["role"], "content": content})
    return out


def _template_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Media parts as the chat templates expect them: `{"type": "image"}` and friends."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = [p if p["type"] == "text" else {"type": p["type"]} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def _collect(stream: Iterator[Any], params: GenParams) -> tuple[str, str | None, Any]:
    """Drain an engine's token stream, applying stop strings on a bounded tail of the text."""
    text = ""
    longest = max((len(s) for s in params.stop), default=0)
    last = None
    for last in stream:
        segment = last.text
        text += segment
        if not longest or not segment:
            continue
        window_start = max(0, len(text) - len(segment) - longest + 1)
        hits = [i for s in params.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            return text[: min(hits)], "stop", last
    return text, None, last


class Engines:
    """Loads each model on first use and runs one row at a time on it."""

    def __init__(self, model: str, text_model: str | None = None):
        self.vision_info = inspect_model(model)
        self.text_info = inspect_model(text_model) if text_model else self.vision_info
        self._vlm: tuple[Any, Any] | None = None
        self._lm: tuple[Any, Any] | None = None
        self._text_on_vlm = False

    # -- loading ---------------------------------------------------------------
    def _load_vlm(self) -> tuple[Any, Any]:
        if self._vlm is None:
            import mlx_vlm
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # one kwargs notice per row otherwise

            model, processor = mlx_vlm.load(str(self.vision_info.path))
            tokenizer = getattr(processor, "tokenizer", processor)
            if END_OF_TURN in tokenizer.get_vocab():
                tokenizer.stopping_criteria.additional_eos_token_ids.append(
                    tokenizer.convert_tokens_to_ids(END_OF_TURN)
                )
            self._vlm = (model, processor)
        return self._vlm

    def _load_lm(self) -> tuple[Any, Any] | None:
        if self._lm is None and not self._text_on_vlm:
            import mlx_lm

            try:
                model, tokenizer = mlx_lm.load(str(self.text_info.path))
            except ValueError as e:
                if not self.text_info.multimodal:
                    raise ConfigError(f"model {self.text_info.name!r}: mlx-lm cannot load it ({e})") from e
                log.info("mlx-lm cannot load %s (%s); text rows use mlx-vlm", self.text_info.name, e)
                self._text_on_vlm = True
                return None
            if END_OF_TURN in tokenizer.get_vocab():
                tokenizer.add_eos_token(END_OF_TURN)
            self._lm = (model, tokenizer)
        return self._lm

    def model_for(self, job: Job) -> str:
        return self.vision_info.name if job.media or self._text_on_vlm else self.text_info.name

    # -- generation ------------------------------------------------------------
    def generate(self, job: Job, media: Media) -> Generation:
        """Run one row; engine failures become a `generate` row error."""
        if media:
            self._check_supported(media)
            return self._guard(self._generate_vlm, job, media)
        if self._load_lm() is None:
            return self._guard(self._generate_vlm, job, media)
        return self._guard(self._generate_lm, job)

    def _check_supported(self, media: Media) -> None:
        info = self.vision_info
        if not info.multimodal:
            raise RowError(
                "generate", f"model {info.name!r} is text-only (no vision or audio tower in its config)"
            )
        if media.audio and not info.audio:
            raise RowError("generate", f"model {info.name!r} has no audio encoder; the row has audio")
        if (media.images or media.videos) and not info.vision:
            raise RowError(
                "generate", f"model {info.name!r} has no vision tower; the row has images or video"
            )

    @staticmethod
    def _guard(fn, *args) -> Generation:
        try:
            return fn(*args)
        except RowError:
            raise
        except Exception as e:  # an engine error fails the row, not the run
            message = " ".join(str(e).split()) or type(e).__name__
            raise RowError("generate", f"{type(e).__name__}: {message[:300]}") from e

    def _generate_lm(self, job: Job) -> Generation:
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        model, tokenizer = self._load_lm()  # type: ignore[misc]
        p = job.params
        if getattr(tokenizer, "chat_template", None):
            prompt = _apply_template(tokenizer, _text_only(job.messages), p.chat_template_kwargs)
        else:  # base models: the turns' text, one per line
            prompt = "\n".join(m["content"] for m in _text_only(job.messages))
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if p.seed is not None:
            mx.random.seed(p.seed)
        stream = stream_generate(
            model,
            tokenizer,
            ids,
            max_tokens=p.max_tokens,
            sampler=make_sampler(p.temperature, p.top_p if p.top_p < 1 else 0.0, p.min_p, top_k=p.top_k),
            logits_processors=make_logits_processors(
                repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
                presence_penalty=p.presence_penalty or None,
            ),
        )
        text, reason, last = _collect(stream, p)
        return _finish(text, reason, last, p, prompt_tokens=len(ids))

    def _generate_vlm(self, job: Job, media: Media) -> Generation:
        from mlx_vlm import stream_generate

        model, processor = self._load_vlm()
        p = job.params
        messages = _template_parts(job.messages) if media else _text_only(job.messages)
        prompt = _apply_template(processor, messages, p.chat_template_kwargs)
        tokenizer = getattr(processor, "tokenizer", processor)
        tokenizer.stopping_criteria.reset(model.config.eos_token_id)
        info = self.vision_info
        images = list(media.images)
        videos = list(media.videos)
        if videos and not info.video:  # models without a video token see frames as images
            from PIL import Image

            images += [Image.fromarray(f) for v in videos for f in v]
            videos = []
        stream = stream_generate(
            model,
            processor,
            prompt,
            image=images or None,
            video=videos or None,
            audio=list(media.audio) or None,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
            presence_penalty=p.presence_penalty or None,
            seed=p.seed,
        )
        text, reason, last = _collect(stream, p)
        return _finish(text, reason, last, p, prompt_tokens=None)


def _finish(text: str, reason: str | None, last: Any, p: GenParams, prompt_tokens: int | None) -> Generation:
    """Counts come from the engine's last response; `length` only when the budget ran out."""
    if last is None:
        return Generation("", "length", prompt_tokens or 0, 0)
    completion = int(last.generation_tokens)
    if reason is None:
        engine_reason = getattr(last, "finish_reason", None)
        reason = "length" if completion >= p.max_tokens and engine_reason != "stop" else "stop"
    return Generation(
        text=text,
        finish_reason=reason,
        prompt_tokens=int(prompt_tokens if prompt_tokens is not None else last.prompt_tokens),
        completion_tokens=completion,
        cached_tokens=int(getattr(last, "cached_tokens", 0) or 0),
    )

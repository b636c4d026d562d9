"""Generate stage: loads each model once and routes every row to its lane (lanes.py).

With decoder.py, lanes.py and single.py, the only place that talks to MLX. Rows are first
planned (routed, tokenized), then run in batches of one lane.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .cache import Memo, PrefixCache
from .config import EngineSettings
from .decoder import Watch
from .draft import Drafter, inspect_drafter, load_text_drafter, load_vision_drafter
from .errors import BatchgenError, ConfigError, RowError, short
from .lanes import DraftLane, Lane, Plan, SingleLane, TextLane, row_error
from .models import ModelInfo, inspect_model
from .prompts import END_OF_TURN
from .records import Generation, Job, Media
from .vision_lanes import OffsetVisionLane, VisionLane

__all__ = ["Plan", "Models", "Engines"]

log = logging.getLogger(__name__)


_TEXT_ONLY_KWARGS = frozenset({"padding", "padding_side", "truncation", "max_length", "add_special_tokens",
                               "pad_to_multiple_of", "return_attention_mask"})  # fmt: skip


_SHARED_IMAGE_BYTES = 256 * 2**20  # images and their processed pixels kept for rows sharing them


class _ImagesOnly:
    """An image processor that is handed only the keyword arguments meant for it."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __call__(self, images: Any, **kwargs: Any) -> Any:
        return self._inner(images, **{k: v for k, v in kwargs.items() if k not in _TEXT_ONLY_KWARGS})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _leaves(images: Any) -> list[Any]:
    return [x for item in images for x in _leaves(item)] if isinstance(images, (list, tuple)) else [images]


class _SharedImages:
    """The image processor, its output kept for images it has seen. Rows asking several
    questions about one image (the captioning pattern) hold the same decoded image object
    (media.py's memo by content), so an image's identity stands for its content here; each
    entry keeps its images alive, so no id is reused while the entry lives. Every call gets
    a copy: processors pop keys from what the image processor returns."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._memo: Memo[tuple[list[Any], Any]] = Memo(32, _SHARED_IMAGE_BYTES, _weight)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from PIL import Image

        images = _leaves(args[0] if args else kwargs.get("images"))
        if not images or not all(isinstance(im, Image.Image) for im in images):
            return self._inner(*args, **kwargs)
        key = (tuple(map(id, images)), repr(args[1:]), repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
        _, out = self._memo.get(key, lambda: (images, self._inner(*args, **kwargs)))
        return copy.deepcopy(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _weight(entry: tuple[list[Any], Any]) -> int:
    """What an entry holds: its images (kept alive by it) and the processor's arrays."""
    images, out = entry
    return sum(im.width * im.height * len(im.getbands()) for im in images) + _nbytes(out)


def _nbytes(value: Any) -> int:
    """Bytes of the arrays in an image processor's output (a mapping, a tuple, arrays)."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, Mapping):  # transformers' BatchFeature is one
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _mend_processor(processor: Any) -> None:
    """mlx-vlm 0.7.10's llava processors hand the tokenizer's `padding=True` to the image
    processor too, which transformers 5 refuses (`ImagesKwargs.__init__() got an unexpected
    keyword argument 'padding'`): every image row of a llava checkpoint would fail."""
    if type(processor).__name__ in ("LlavaProcessor", "LlavaNextProcessor") and hasattr(
        processor, "image_processor"
    ):
        processor.image_processor = _ImagesOnly(processor.image_processor)


_UNBATCHED = {  # families that cannot batch, and why
    "paligemma": "its prompt prefix attends both ways, so padding and prefix snapshots change results",
    "bidirectional": "its image tokens attend both ways (use_bidirectional_attention: vision), so padding "
    "and prefix snapshots change results",
}


class Models:
    """The run's checkpoints, each loaded once on first use. A load failure is a ConfigError,
    kept and raised again for every later use rather than retried for every row."""

    def __init__(self, vision_info: ModelInfo, text_info: ModelInfo, drafter: Drafter | None = None):
        self.vision_info, self.text_info, self.drafter = vision_info, text_info, drafter
        self._vlm: tuple[Any, Any] | None = None
        self._lm: tuple[Any, Any] | None = None
        self._failed: dict[str, ConfigError] = {}
        self.text_on_vlm = False  # mlx-lm cannot load this VLM checkpoint: mlx-vlm serves text rows

    @property
    def drafter_lane(self) -> str | None:
        return self.drafter.lane if self.drafter is not None else None

    def vlm(self) -> tuple[Any, Any]:
        if "vlm" in self._failed:
            raise self._failed["vlm"]
        if self._vlm is None:
            import mlx_vlm
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # one kwargs notice per row otherwise
            try:
                model, processor = mlx_vlm.load(str(self.vision_info.path))
            except Exception as e:  # loaders fail in many ways; all of them stop the run the same way
                self._failed["vlm"] = ConfigError(
                    f"model {self.vision_info.name!r}: mlx-vlm cannot load it ({e})"
                )
                raise self._failed["vlm"] from e
            _mend_processor(processor)
            if hasattr(processor, "image_processor"):
                processor.image_processor = _SharedImages(processor.image_processor)
            tokenizer = getattr(processor, "tokenizer", processor)
            criteria = getattr(tokenizer, "stopping_criteria", None)
            if criteria is not None and END_OF_TURN in tokenizer.get_vocab():
                criteria.additional_eos_token_ids.append(tokenizer.convert_tokens_to_ids(END_OF_TURN))
            self._vlm = (model, processor)
        return self._vlm

    def lm(self) -> tuple[Any, Any] | None:
        """The text model through mlx-lm, or None when mlx-lm cannot load this (multimodal)
        checkpoint and mlx-vlm serves its text rows."""
        if "lm" in self._failed:
            raise self._failed["lm"]
        if self._lm is None and not self.text_on_vlm:
            import mlx_lm

            try:
                model, tokenizer = mlx_lm.load(str(self.text_info.path))
            except Exception as e:  # an architecture mlx-lm lacks (ValueError), missing weights, ...
                if not self.text_info.multimodal:
                    self._failed["lm"] = ConfigError(
                        f"model {self.text_info.name!r}: mlx-lm cannot load it ({e})"
                    )
                    raise self._failed["lm"] from e
                # Any failure on a multimodal checkpoint (a tied checkpoint without `lm_head`, a
                # TypeError in a model class): mlx-vlm, which loads it, serves the text rows.
                log.warning(
                    "mlx-lm cannot load %s (%s: %s); text rows use mlx-vlm",
                    self.text_info.name, type(e).__name__, short(e),
                )  # fmt: skip
                self.text_on_vlm = True
                return None
            if END_OF_TURN in tokenizer.get_vocab():
                tokenizer.add_eos_token(END_OF_TURN)
            self._lm = (model, tokenizer)
        return self._lm

    def load_drafter(self) -> None:
        """Load the target and the drafter now: a drafter that cannot pair with the target is a
        configuration error before any row runs."""
        d = self.drafter
        if d is None or d.model is not None:
            return
        if d.lane == "vlm":
            load_vision_drafter(d, self.vlm()[0])
        else:
            target = self.lm()
            if target is None:
                raise ConfigError(
                    f"draft model {str(d.path)!r} is a text model, but mlx-lm cannot load the target"
                )
            load_text_drafter(d, target[0])


class Engines:
    """The run's models, lanes and prefix cache: plans each row (one routing function) and
    runs batches of plans of one lane."""

    def __init__(
        self,
        model: str,
        text_model: str | None = None,
        prefix_cache: PrefixCache | None = None,
        drafter: Drafter | None = None,
        row_timeout: float | None = None,
    ):
        self.vision_info = inspect_model(model)
        self.text_info = inspect_model(text_model) if text_model else self.vision_info
        self.prefixes = prefix_cache
        self.models = Models(self.vision_info, self.text_info, drafter)
        self.text = TextLane(self.models, self.text_info, prefix_cache)
        self.vision = VisionLane(self.models, self.vision_info, prefix_cache)
        self.offset = OffsetVisionLane(self.models, self.vision_info, prefix_cache)
        self.single = SingleLane(self.models, self.vision_info)
        self.draft = DraftLane(self.models, self.text_info, self.text)
        self.row_timeout = row_timeout  # seconds a row may generate, counted from its batch's start
        self.stop = threading.Event()  # the runner's stop request, checked between decode steps
        self.capped = 0  # rows whose max_tokens was lowered to fit the model's context
        self.one_at_a_time: dict[str, int] = {}  # media rows that could not batch, by reason

    @classmethod
    def from_config(cls, config: EngineSettings) -> Engines:
        """The engines a run asks for: its models, a prefix cache unless --no-cache, its drafter."""
        prefixes = PrefixCache(config.cache_entries, config.cache_bytes) if config.cache else None
        drafter = None
        if config.draft_model:
            drafter = inspect_drafter(
                config.draft_model, config.draft_kind, config.draft_block_size, config.num_draft_tokens
            )
        return cls(config.model, config.text_model, prefixes, drafter, config.row_timeout)

    # -- loading ---------------------------------------------------------------
    def load(self, vision: bool, text: bool) -> None:
        """Load up front what the first rows need (so it overlaps their downloads)."""
        if text and not self._text_via_vlm() and self.models.lm() is None:
            vision = True
        if vision and (self.vision_info.multimodal or self.models.text_on_vlm) or self._text_via_vlm():
            self.models.vlm()

    def load_drafter(self) -> None:
        self.models.load_drafter()

    def _text_via_vlm(self) -> bool:
        """A vision drafter serves text rows too when they share its target."""
        return self.models.drafter_lane == "vlm" and self.text_info is self.vision_info

    def model_for(self, job: Job) -> str:
        on_vlm = job.media or self.models.text_on_vlm or self._text_via_vlm()
        return self.vision_info.name if on_vlm else self.text_info.name

    # -- planning --------------------------------------------------------------
    def route(self, job: Job, media: Media) -> Lane:
        """The lane of a row: text rows on mlx-lm (speculative with a text drafter), media rows
        (and text rows mlx-lm cannot serve) batched on the vision lane where the family allows,
        else one at a time through mlx-vlm."""
        constrained = job.params.constraint is not None  # a drafter's guesses would skip the mask
        if not media and not self._text_via_vlm() and self.models.lm() is not None:
            return self.draft if self.models.drafter_lane == "lm" and not constrained else self.text
        model = self.models.vlm()[0]
        family = model.config.model_type
        if self.models.drafter_lane == "vlm" and not constrained:
            return self._alone("the vision drafter runs inside mlx-vlm's generate")
        if media.audio:
            return self._alone("rows with audio")
        if family in VisionLane.FAMILIES:
            if media.images and media.videos:  # mlx-vlm's Qwen-VL embeds one kind per prompt
                return self._alone(f"{family}: rows with images beside a video")
            return self.vision
        if family in OffsetVisionLane.FAMILIES:
            if media.videos:
                return self._alone(f"{family}: video rows")
            if getattr(model.config.text_config, "use_bidirectional_attention", None) == "vision":
                return self._alone(f"{family}: {_UNBATCHED['bidirectional']}")
            if family in OffsetVisionLane.RELAID and len(media.images) > 1:
                return self._alone(f"{family}: rows with several images (mlx-vlm merges the first only)")
            return self.offset
        return self._alone(f"{family}: {_UNBATCHED.get(family, 'no batched lane for this family yet')}")

    def _alone(self, reason: str) -> Lane:
        """The one-row lane, with the reason counted for the run summary."""
        self.one_at_a_time[reason] = self.one_at_a_time.get(reason, 0) + 1
        return self.single

    def plan(self, job: Job, media: Media) -> Plan:
        """Route and tokenize the row; unsupported media raise a `generate` RowError, a model
        that cannot load stops the run (ConfigError), wherever its first row is."""
        if media:
            self._check_supported(media)
        try:
            return self.route(job, media).plan(job, media)
        except (RowError, BatchgenError):
            raise
        except Exception as e:  # a template or processor that rejects this row
            raise row_error(e) from e

    # -- generation ------------------------------------------------------------
    def run(self, plans: list[Plan], width: int) -> Iterator[tuple[int, Generation | RowError]]:
        """Plans of one lane, at most `width` decoding at once; each row's Generation or RowError
        as it finishes. A row past --row-timeout is a `generate` error; a stop request raises
        StopRequested."""
        lane = plans[0].lane
        for i, outcome in lane.run(plans, Watch(self.stop, self.row_timeout, lane.info.context), width):
            if isinstance(outcome, Generation):
                self.capped += outcome.capped
                if outcome.finish_reason == "timeout":
                    outcome = RowError(
                        "generate",
                        f"no answer within --row-timeout {self.row_timeout:g} s "
                        f"({outcome.completion_tokens} tokens generated)",
                    )
            yield i, outcome

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

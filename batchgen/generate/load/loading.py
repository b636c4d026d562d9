"""The run's checkpoints, loaded once by the engines' own loaders; the image processor shared."""

from __future__ import annotations

import copy
import gc
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from PIL import Image

from ...core.errors import ConfigError, RowError, short
from ...core.files import ADAPTER_FILES, adapter_config, adapter_digest
from ...core.memo import Memo
from ...core.records import IMAGE_DIGEST
from ..base.arrays import Model, Processor, Tokenizer, load_lm, parameters, safetensors
from ..base.aside import at_home
from ..base.models import ModelInfo, weights_path
from ..chat.prompts import END_OF_TURN
from ..chat.traits import Traits
from .drafts import Drafter, load_text_drafter, load_vision_drafter
from .fine_tunes import AdapterSet

__all__ = ["Models", "SharedImages", "SHARED_IMAGE_BYTES", "mend_processor"]

log = logging.getLogger(__name__)

_TEXT_ONLY_KWARGS = frozenset(
    {
        "padding",
        "padding_side",
        "truncation",
        "max_length",
        "add_special_tokens",
        "pad_to_multiple_of",
        "return_attention_mask",
    }
)


SHARED_IMAGE_BYTES = 256 * 2**20  # processed pixels kept for rows sharing their images


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


class SharedImages:
    """The image processor, its output kept for images it has seen: rows asking several
    questions about one image (the captioning pattern) process it once. Keyed on content: the
    digest the media stage decoded each image from (`IMAGE_DIGEST` in its info), else a hash
    of its pixels. Every call gets a copy: processors pop keys from what the image processor
    returns."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.memo: Memo[Any] = Memo(32, SHARED_IMAGE_BYTES, _nbytes)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        images = _leaves(args[0] if args else kwargs.get("images"))
        if not images or not all(isinstance(im, Image.Image) for im in images):
            return self._inner(*args, **kwargs)
        # By content, never identity: the images' digests and the other arguments (an `images=`
        # keyword's repr names the objects, so equal pictures decoded twice would never meet).
        options = repr(sorted(((k, v) for k, v in kwargs.items() if k != "images"), key=lambda kv: kv[0]))
        key = (tuple(map(_content, images)), repr(args[1:]), options)
        return copy.deepcopy(self.memo.get(key, lambda: self._inner(*args, **kwargs)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _content(image: Image.Image) -> str:
    """An image's content key: the digest it was decoded from, else its pixels' (with its mode
    and size, as mlx-vlm's vision cache keys an image)."""
    digest = image.info.get(IMAGE_DIGEST)
    if isinstance(digest, str):
        return digest
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _nbytes(value: Any) -> int:
    """Bytes of the arrays in an image processor's output (a mapping, a tuple, arrays)."""
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, Mapping):  # transformers' BatchFeature is one
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _check_fits(model: Model, adapter: str) -> None:
    """Every tensor of the adapter has its place in the model: mlx-vlm loads an adapter's weights
    non-strictly, so an adapter made for another base (or in mlx-lm's layout) would load and
    change nothing."""
    weights = safetensors(str(Path(adapter) / ADAPTER_FILES[1]))
    have = {name: w.shape for name, w in parameters(model)}
    off = [name for name, w in weights.items() if have.get(name) != w.shape]
    if off:
        raise ValueError(
            f"{len(off)} of its {len(weights)} tensors have no place in the model (first: {off[0]})"
        )


def _check_base(model: Model, config: dict[str, Any]) -> None:
    """mlx-vlm first quantizes the layers an adapter's `base_quantization` names (it was trained
    on a quantized base): on layers not quantized here that would change the base model for
    every row after it, and taking the adapter off would not undo it."""
    named = config.get("base_quantization") or {}
    if not isinstance(named, dict):
        raise ValueError("base_quantization: expected an object")
    modules = dict(model.named_modules())
    plain = [name for name in named if isinstance(modules.get(name), (nn.Linear, nn.Embedding))]
    if plain:
        raise ValueError(
            f"it was trained on a quantized base and {len(plain)} of the layers it names are not "
            f"quantized in this model (first: {plain[0]})"
        )


def _take_off(model: Model) -> None:
    """A model's LoRA/DoRA layers replaced by the layers they wrap: the base model again. Both
    engines keep the wrapped layer as `linear` beside `lora_a` (mlx-vlm's older layers as
    `original_layer` beside `A`)."""
    wrapped = [
        (name, module["linear"] if "lora_a" in module else module["original_layer"])
        for name, module in model.named_modules()
        if "lora_a" in module and "linear" in module or "A" in module and "original_layer" in module
    ]
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))


def mend_processor(processor: Processor) -> None:
    """mlx-vlm 0.7.10's llava processors hand the tokenizer's `padding=True` to the image
    processor too, which transformers 5 refuses (`ImagesKwargs.__init__() got an unexpected
    keyword argument 'padding'`): every image row of a llava checkpoint would fail."""
    if type(processor).__name__ in ("LlavaProcessor", "LlavaNextProcessor") and hasattr(
        processor, "image_processor"
    ):
        processor.image_processor = _ImagesOnly(processor.image_processor)


class Models:
    """The run's checkpoints, each loaded once on first use. A load failure is a ConfigError,
    kept and raised again for every later use rather than retried for every row. `lazy`
    (batchgen plan): the weights are mapped, never read — tokenizers, processors and configs
    are all a plan needs. `adapter`: a LoRA/DoRA folder the engine applies as it loads the
    model (mlx-vlm's format on a vision-language checkpoint, whose text rows then run on
    mlx-vlm too; mlx-lm's on a text model)."""

    def __init__(
        self,
        vision_info: ModelInfo,
        text_info: ModelInfo,
        drafter: Drafter | None = None,
        lazy: bool = False,
        adapters: AdapterSet | None = None,
    ):
        self.vision_info, self.text_info, self.drafter = vision_info, text_info, drafter
        self.adapters = adapters or AdapterSet()  # the run's, the named ones, the rows' folders
        self.lazy, self.adapter, self.fuse = lazy, self.adapters.run, self.adapters.fuse
        self._fused: list[tuple[str, nn.Module]] = []  # the adapter's layers, while fused weights stand in
        self.applied = self.adapter  # the adapter the model carries once loaded
        self.digests: dict[str, str] = {}  # each adapter applied: its content as the model took it
        self.switches = 0
        self.loads = 0  # checkpoints loaded (an engine each)
        self._vlm: tuple[Model, Processor] | None = None
        self._lm: tuple[Model, Tokenizer] | None = None
        self._traits: dict[bool, Traits] = {}  # each loaded model's (by: the vision model's)
        self._failed: dict[str, ConfigError] = {}
        # mlx-lm cannot load this VLM checkpoint, or the adapter is for mlx-vlm: it serves text rows
        self.text_on_vlm = self.adapters.any and text_info.multimodal

    def loaded(self) -> list[Model]:
        """The models loaded so far (the memory budget counts their weights once)."""
        found = [pair[0] for pair in (self._vlm, self._lm) if pair is not None]
        drafter = self.drafter.model if self.drafter is not None else None
        return found + ([drafter] if drafter is not None and hasattr(drafter, "parameters") else [])

    @property
    def vlm_loaded(self) -> bool:
        return self._vlm is not None

    @property
    def lm_loaded(self) -> bool:
        return self._lm is not None

    def release(self) -> None:
        """Let go of the loaded weights (a run of several models frees one before the next)."""
        self._vlm = self._lm = None
        self._traits.clear()
        if self.drafter is not None:
            self.drafter.model = None
        gc.collect()
        mx.clear_cache()

    def caches(self) -> list[Any]:
        """The processed-image memo, once the vision model is loaded."""
        images = getattr(self._vlm[1], "image_processor", None) if self._vlm is not None else None
        return [images.memo] if isinstance(images, SharedImages) else []

    @property
    def drafter_lane(self) -> str | None:
        return self.drafter.lane if self.drafter is not None else None

    def vlm(self) -> tuple[Model, Processor]:
        if "vlm" in self._failed:
            raise self._failed["vlm"]
        if self._vlm is None:
            at_home("loading the vision model")
            import mlx_vlm
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # one kwargs notice per row otherwise
            try:
                self._read_digest()
                model, processor = mlx_vlm.load(
                    weights_path(self.vision_info), lazy=self.lazy, adapter_path=self.adapter
                )
                if self.adapter is not None:
                    _check_fits(model, self.adapter)
                    self._fuse(model)
            except Exception as e:  # loaders fail in many ways; all of them stop the run the same way
                self._failed["vlm"] = ConfigError(
                    f"model {self.vision_info.name!r}{self._with()}: mlx-vlm cannot load it ({short(e, 400)})"
                )
                raise self._failed["vlm"] from e
            self.loads += 1
            mend_processor(processor)
            if hasattr(processor, "image_processor"):
                processor.image_processor = SharedImages(processor.image_processor)
            tokenizer: Tokenizer = getattr(processor, "tokenizer", processor)
            criteria = getattr(tokenizer, "stopping_criteria", None)
            if criteria is not None and END_OF_TURN in tokenizer.get_vocab():
                criteria.additional_eos_token_ids.append(tokenizer.convert_tokens_to_ids(END_OF_TURN))
            self._vlm = (model, processor)
            self._traits[True] = Traits.of(processor)
        return self._vlm

    def traits(self, vision: bool) -> Traits:
        """The traits of the model a lane runs on: the vision model's, or the text rows' (the
        mlx-lm model's, or the vision model's where that serves them); loaded first if need be."""
        if not vision and self.lm() is not None:
            return self._traits[False]
        self.vlm()
        return self._traits[True]

    def text(self) -> tuple[Model, Tokenizer]:
        """The text model through mlx-lm, where a lane that runs on it has been chosen."""
        found = self.lm()
        if found is None:
            raise ValueError("no mlx-lm text model: mlx-vlm serves the text rows")
        return found

    def lm(self) -> tuple[Model, Tokenizer] | None:
        """The text model through mlx-lm, or None when mlx-lm cannot load this (multimodal)
        checkpoint and mlx-vlm serves its text rows."""
        if "lm" in self._failed:
            raise self._failed["lm"]
        if self._lm is None and not self.text_on_vlm:
            at_home("loading the text model")
            try:
                self._read_digest()
                model, tokenizer = load_lm(weights_path(self.text_info), lazy=self.lazy, adapter=self.adapter)
                if self.adapter is not None:
                    self._fuse(model)
            except Exception as e:  # an architecture mlx-lm lacks (ValueError), missing weights, ...
                if not self.text_info.multimodal:
                    why = f"mlx-lm cannot load it ({short(e, 400)})"
                    self._failed["lm"] = ConfigError(f"model {self.text_info.name!r}{self._with()}: {why}")
                    raise self._failed["lm"] from e
                # Any failure on a multimodal checkpoint (a tied checkpoint without `lm_head`, a
                # TypeError in a model class): mlx-vlm, which loads it, serves the text rows.
                log.warning(
                    "mlx-lm cannot load %s (%s: %s); text rows use mlx-vlm",
                    self.text_info.name,
                    type(e).__name__,
                    short(e),
                )
                self.text_on_vlm = True
                return None
            self.loads += 1
            if END_OF_TURN in tokenizer.get_vocab():
                tokenizer.add_eos_token(END_OF_TURN)
            self._lm = (model, tokenizer)
            self._traits[False] = Traits.of(tokenizer)
        return self._lm

    def use(self, adapter: str | None) -> None:
        """The model carries this adapter (None: none) for the rows that follow: the one it
        carries taken off (its LoRA/DoRA layers back to the layers they wrap), this one applied
        as the engine applies one when it loads it. An adapter that cannot apply is the error
        of the rows that asked for it (a `generate` RowError); the model is left bare."""
        if adapter == self.applied or self.lazy:
            return
        vision = self.text_info.multimodal
        model = self.vlm()[0] if vision else self.text()[0]
        self._unfuse(model)
        _take_off(model)
        self.applied, self.switches = None, self.switches + 1
        if adapter is None:
            return
        try:
            self.digests[adapter] = adapter_digest(adapter)
            config = adapter_config(adapter)  # as it is now: a LoRA or DoRA, a rank it can hold
            if vision:
                from mlx_vlm.trainer.peft.utils import apply_lora_layers

                _check_base(model, config)
                apply_lora_layers(model, adapter)
                _check_fits(model, adapter)
            else:
                from mlx_lm.tuner.utils import load_adapters

                load_adapters(model, adapter)
            self._fuse(model)
        except Exception as e:  # an adapter for another base, a broken file: those rows' error
            self._unfuse(model)
            _take_off(model)
            raise RowError(
                "generate", f"adapter {adapter!r} cannot apply to {self.text_info.name!r} ({short(e, 300)})"
            ) from e
        model.eval()
        self.applied = adapter

    def _fuse(self, model: Model) -> None:
        """--fuse-adapters: each of the adapter's layers replaced by the one `mlx_lm fuse` would
        save (its own `fuse()`: the delta added into the base weights), so rows decode at the
        base model's cost and equal a run of the fused checkpoint; the adapter's layers are kept
        to put back before it is taken off."""
        if not self.fuse or self.lazy:
            return
        self._fused = [(name, m) for name, m in model.named_modules() if "lora_a" in m and hasattr(m, "fuse")]
        fused = [(name, m.fuse()) for name, m in self._fused]
        model.update_modules(tree_unflatten(fused))
        mx.eval([m.parameters() for _, m in fused])

    def _unfuse(self, model: Model) -> None:
        if self._fused:
            model.update_modules(tree_unflatten(self._fused))
            self._fused = []

    def _read_digest(self) -> None:
        """The run's adapter's content, read as the engine loads it."""
        if self.adapter is not None and not self.lazy:
            self.digests[self.adapter] = adapter_digest(self.adapter)

    def _with(self) -> str:
        """The adapter, as an error names it beside its model."""
        return f" with adapter {self.adapter!r}" if self.adapter else ""

    def load_drafter(self) -> None:
        """Load the target and the drafter now: a drafter that cannot pair with the target is a
        configuration error before any row runs."""
        d = self.drafter
        if d is None or d.model is not None:
            return
        at_home("loading the drafter")
        if d.lane == "vlm":
            load_vision_drafter(d, self.vlm()[0])
        else:
            target = self.lm()
            if target is None:
                raise ConfigError(
                    f"draft model {str(d.path)!r} is a text model, but mlx-lm cannot load the target"
                )
            load_text_drafter(d, target[0])

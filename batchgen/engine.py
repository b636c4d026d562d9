"""Generate stage: loads models, builds prompts, and runs rows (mlx-lm for text, mlx-vlm for media).

With decoder.py, the only place that talks to MLX. Rows are first planned (tokenized, their
lane chosen), then run in batches through the decoder, or one by one through mlx-vlm's
own generate for inputs the decoder does not handle (video, audio, other model families).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .cache import Memo, PrefixCache
from .config import RunConfig
from .decoder import LMAdapter, Sequence, VLMAdapter, Watch, decode_batch
from .draft import Drafter, inspect_drafter, load_text_drafter, load_vision_drafter
from .errors import BatchgenError, ConfigError, RowError, short
from .models import ModelInfo, inspect_model
from .prompts import (
    END_OF_TURN,
    after_media,
    apply_template,
    check_length,
    message_bounds,
    template_parts,
    text_only,
)
from .records import Generation, Job, Media
from .single import generate_draft_lm, generate_vlm

__all__ = ["Plan", "Engines"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Plan:
    """A row ready for an engine: its lane, the decoder sequence, and the batch grouping key."""

    job: Job
    media: Media
    lane: str  # "lm" | "vlm": batched decoder; "single": mlx-vlm's own generate; "draft": mlx-lm speculative
    seq: Sequence | None = None
    group: tuple = ()  # rows with equal groups share prefixes: run them together

    @property
    def solo(self) -> bool:
        """Seeded sampling must not share a batch: its draws would depend on the others."""
        p = self.job.params
        return self.lane in ("single", "draft") or (p.seed is not None and p.temperature > 0)


class Engines:
    """Loads each model on first use; plans rows and runs them in batches."""

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
        self.drafter = drafter
        self._vlm: tuple[Any, Any] | None = None
        self._lm: tuple[Any, Any] | None = None
        self._text_on_vlm = False
        self._features: Memo[Any] = Memo(64)  # vision-tower outputs by image digests
        self.row_timeout = row_timeout  # seconds a row may generate, counted from its batch's start
        self.stop = threading.Event()  # the runner's stop request, checked between decode steps
        self.capped = 0  # rows whose max_tokens was lowered to fit the model's context

    @classmethod
    def from_config(cls, config: RunConfig) -> Engines:
        """The engines a run asks for: its models, a prefix cache unless --no-cache, its drafter."""
        prefixes = PrefixCache(config.cache_entries, config.cache_bytes) if config.cache else None
        drafter = None
        if config.draft_model:
            drafter = inspect_drafter(
                config.draft_model, config.draft_kind, config.draft_block_size, config.num_draft_tokens
            )
        return cls(config.model, config.text_model, prefixes, drafter, config.row_timeout)

    # -- loading ---------------------------------------------------------------
    def _load_vlm(self) -> tuple[Any, Any]:
        if self._vlm is None:
            import mlx_vlm
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # one kwargs notice per row otherwise

            try:
                model, processor = mlx_vlm.load(str(self.vision_info.path))
            except Exception as e:  # loaders fail in many ways; all of them stop the run the same way
                raise ConfigError(f"model {self.vision_info.name!r}: mlx-vlm cannot load it ({e})") from e
            tokenizer = getattr(processor, "tokenizer", processor)
            criteria = getattr(tokenizer, "stopping_criteria", None)
            if criteria is not None and END_OF_TURN in tokenizer.get_vocab():
                criteria.additional_eos_token_ids.append(tokenizer.convert_tokens_to_ids(END_OF_TURN))
            self._vlm = (model, processor)
        return self._vlm

    def _load_lm(self) -> tuple[Any, Any] | None:
        if self._lm is None and not self._text_on_vlm:
            import mlx_lm

            try:
                model, tokenizer = mlx_lm.load(str(self.text_info.path))
            except Exception as e:  # an architecture mlx-lm lacks is a ValueError; other failures too
                if not self.text_info.multimodal or not isinstance(e, ValueError):
                    raise ConfigError(f"model {self.text_info.name!r}: mlx-lm cannot load it ({e})") from e
                log.info("mlx-lm cannot load %s (%s); text rows use mlx-vlm", self.text_info.name, e)
                self._text_on_vlm = True
                return None
            if END_OF_TURN in tokenizer.get_vocab():
                tokenizer.add_eos_token(END_OF_TURN)
            self._lm = (model, tokenizer)
        return self._lm

    def load(self, vision: bool, text: bool) -> None:
        """Load up front what the first rows need (so it overlaps their downloads)."""
        if text and not self._text_via_vlm() and self._load_lm() is None:
            vision = True
        if vision and self.vision_info.multimodal or (vision and self._text_on_vlm) or self._text_via_vlm():
            self._load_vlm()

    def load_drafter(self) -> None:
        """Load the target and the drafter now: a drafter that cannot pair with the target is a
        configuration error before any row runs."""
        d = self.drafter
        if d is None or d.model is not None:
            return
        if d.lane == "vlm":
            model, _ = self._load_vlm()
            load_vision_drafter(d, model)
        else:
            if self._load_lm() is None:
                raise ConfigError(
                    f"draft model {str(d.path)!r} is a text model, but mlx-lm cannot load the target"
                )
            load_text_drafter(d, self._lm[0])  # type: ignore[index]

    def _text_via_vlm(self) -> bool:
        """A vision drafter serves text rows too when they share its target."""
        return self.drafter is not None and self.drafter.lane == "vlm" and self.text_info is self.vision_info

    def model_for(self, job: Job) -> str:
        on_vlm = job.media or self._text_on_vlm or self._text_via_vlm()
        return self.vision_info.name if on_vlm else self.text_info.name

    # -- planning --------------------------------------------------------------
    def plan(self, job: Job, media: Media) -> Plan:
        """Tokenize the row and choose its lane; unsupported media raise a `generate` RowError."""
        if media:
            self._check_supported(media)
        try:
            if not media and not self._text_via_vlm() and self._load_lm() is not None:
                if self.drafter is not None and self.drafter.lane == "lm":
                    return Plan(job, media, "draft", self._plan_lm(job, media).seq)  # tokenized once
                return self._plan_lm(job, media)
            model, _ = self._load_vlm()
            batchable = model.config.model_type in _DECODER_FAMILIES and not media.videos and not media.audio
            if self.drafter is not None and self.drafter.lane == "vlm":
                batchable = False  # the drafter runs inside mlx-vlm's generate, one row at a time
            return self._plan_vlm(job, media) if batchable else Plan(job, media, "single")
        except (RowError, BatchgenError):  # a model that cannot load stops the run, wherever its first row is
            raise
        except Exception as e:  # a template or processor that rejects this row
            raise _row_error(e) from e

    def _plan_lm(self, job: Job, media: Media) -> Plan:
        model, tokenizer = self._lm  # type: ignore[misc]
        p = job.params
        messages = text_only(job.messages)
        if getattr(tokenizer, "chat_template", None):
            prompt = apply_template(tokenizer, messages, p.chat_template_kwargs)
        else:  # base models: the turns' text, one per line
            prompt = "\n".join(m["content"] for m in messages)
        check_length(prompt, None, self.text_info)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        check_length(prompt, ids, self.text_info)
        bounds = message_bounds(tokenizer, messages, p.chat_template_kwargs, ids)
        seq = _fit(Sequence(ids=ids, params=p, boundaries=self._keys("lm", ids, bounds, [])), self.text_info)
        return Plan(job, media, "lm", seq, group=("lm", tuple(ids[: bounds[-1]]) if bounds else ()))

    def _plan_vlm(self, job: Job, media: Media) -> Plan:
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        model, processor = self._vlm  # type: ignore[misc]
        p = job.params
        messages = template_parts(job.messages) if media else text_only(job.messages)
        prompt = apply_template(processor, messages, p.chat_template_kwargs)
        check_length(prompt, None, self.vision_info)
        inputs = prepare_inputs(
            processor,
            images=media.images or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
        )
        input_ids = inputs["input_ids"]
        ids = input_ids[0].tolist()
        check_length(prompt, ids, self.vision_info)
        lm = model.language_model
        grid = inputs.get("image_grid_thw")
        if media.images:
            positions, delta = lm.get_rope_index(input_ids, grid, None, inputs.get("attention_mask"))
            delta = int(delta.reshape(-1)[0].item())
        else:
            positions, delta = mx.broadcast_to(mx.arange(len(ids)).reshape(1, 1, -1), (3, 1, len(ids))), 0
        start_id = getattr(model.config, "vision_start_token_id", None)
        media_starts = [i for i, t in enumerate(ids) if t == start_id]
        bounds = sorted({*media_starts, *(after_media(ids, model.config) if media.images else [])})
        digests = list(media.image_digests)
        embed = self._embedder(model, inputs, ids, digests) if media.images else None
        keyed = self._keys("vlm", ids, bounds, [(s, d) for s, d in zip(media_starts, digests, strict=False)])
        seq = Sequence(ids=ids, params=p, boundaries=keyed, embed=embed, positions=positions, delta=delta)
        seq = _fit(seq, self.vision_info)
        return Plan(
            job,
            media,
            "vlm",
            seq,
            group=("vlm", tuple(digests), tuple(ids[: media_starts[0]]) if media_starts else ()),
        )

    def _embedder(self, model: Any, inputs: dict, ids: list[int], digests: list[str]):
        """Embeddings of any slice of the prompt; the vision tower runs only when a slice
        holds image tokens, and once per set of images."""
        full: list[Any] = []
        image_id = model.config.image_token_id
        lm = model.language_model

        def embed(a: int, b: int):
            import mlx.core as mx

            if image_id not in ids[a:b]:
                return lm.model.embed_tokens(mx.array(ids[a:b])[None])
            if not full:
                pixel_values, grid = inputs["pixel_values"], inputs["image_grid_thw"]
                features = self._features.get(
                    tuple(digests), lambda: model.vision_tower(pixel_values.astype(_dtype(model)), grid)
                )
                out = model.get_input_embeddings(
                    inputs["input_ids"], pixel_values, image_grid_thw=grid,
                    mask=inputs.get("attention_mask"), cached_image_features=features,
                )  # fmt: skip
                full.append(out.inputs_embeds)
            return full[0][:, a:b]

        return embed

    def _keys(self, lane: str, ids: list[int], bounds: list[int], media: list[tuple[int, str]]):
        """Content keys of each prefix: the model, the prefix's token ids, and the digest of
        every image that starts inside it (image tokens alone are the same for all images)."""
        name = self.vision_info.name if lane == "vlm" else self.text_info.name
        keys = []
        for pos in bounds:
            h = hashlib.sha256(f"{lane}:{name}".encode())
            h.update(",".join(map(str, ids[:pos])).encode())
            for start, digest in media:
                if start < pos:
                    h.update(digest.encode())
            keys.append((pos, h.hexdigest()))
        return keys

    # -- generation ------------------------------------------------------------
    def _watch(self, info: ModelInfo) -> Watch:
        deadline = time.monotonic() + self.row_timeout if self.row_timeout else None
        return Watch(self.stop, deadline, info.context)

    def run(self, plans: list[Plan]) -> list[Generation | RowError]:
        """One batch of plans of one lane; each row gets its Generation or its RowError. A row
        past --row-timeout is a `generate` error; a stop request raises StopRequested."""
        outcomes = self._run(plans)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Generation):
                self.capped += outcome.capped
                if outcome.finish_reason == "timeout":
                    outcomes[i] = RowError(
                        "generate",
                        f"no answer within --row-timeout {self.row_timeout:g} s "
                        f"({outcome.completion_tokens} tokens generated)",
                    )
        return outcomes

    def _run(self, plans: list[Plan]) -> list[Generation | RowError]:
        lane = plans[0].lane
        if lane == "single":
            return [self._guard(self._run_single, plan) for plan in plans]
        if lane == "draft":
            return [self._guard(self._run_draft, plan) for plan in plans]
        if lane == "lm":
            model, tokenizer = self._lm  # type: ignore[misc]
            adapter, eos = LMAdapter(model), set(tokenizer.eos_token_ids)
        else:
            model, processor = self._vlm  # type: ignore[misc]
            tokenizer = getattr(processor, "tokenizer", processor)
            tokenizer.stopping_criteria.reset(model.config.eos_token_id)
            adapter, eos = VLMAdapter(model), set(tokenizer.stopping_criteria.eos_token_ids)
        seqs = [plan.seq for plan in plans]
        watch = self._watch(self.vision_info if lane == "vlm" else self.text_info)
        try:
            decode_batch(adapter, seqs, eos, tokenizer.decode, self.prefixes, watch)  # type: ignore[arg-type]
        except Exception as e:  # an engine error fails these rows, not the run
            if len(plans) == 1:
                return [_row_error(e)]
            return [r for plan in plans for r in self._run([_fresh(plan)])]  # find the culprit
        return [
            Generation(s.text, s.finish_reason, len(s.ids), len(s.tokens), s.cached_tokens, capped=s.capped)
            for s in seqs  # type: ignore[union-attr]
        ]

    @staticmethod
    def _guard(fn, plan: Plan) -> Generation | RowError:
        try:
            return fn(plan)
        except RowError as e:
            return e
        except BatchgenError:
            raise
        except Exception as e:
            return _row_error(e)

    def _run_single(self, plan: Plan) -> Generation:
        model, processor = self._load_vlm()
        drafter = self.drafter if self.drafter is not None and self.drafter.lane == "vlm" else None
        if drafter is not None:
            self.load_drafter()
        return generate_vlm(
            model, processor, self.vision_info, plan.job, plan.media, drafter, self._watch(self.vision_info)
        )

    def _run_draft(self, plan: Plan) -> Generation:
        model, tokenizer = self._lm  # type: ignore[misc]
        seq = plan.seq
        watch = self._watch(self.text_info)
        gen = generate_draft_lm(model, tokenizer, seq.ids, seq.params, self.drafter, watch)  # type: ignore
        gen.capped = gen.capped or seq.capped  # type: ignore[union-attr]
        return gen

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


_DECODER_FAMILIES = {"qwen2_vl", "qwen2_5_vl"}  # mRoPE models whose language model takes position ids


def _dtype(model: Any):
    return model.vision_tower.patch_embed.proj.weight.dtype


def _fresh(plan: Plan) -> Plan:
    """The same plan with cleared outputs, to run again on its own."""
    s = plan.seq
    seq = Sequence(s.ids, s.params, s.boundaries, s.embed, s.positions, s.delta, capped=s.capped)  # type: ignore
    return Plan(plan.job, plan.media, plan.lane, seq, plan.group)


def _fit(seq: Sequence, info: ModelInfo) -> Sequence:
    """max_tokens lowered to what the model's context leaves after the prompt (the row then
    ends with `length`): a row asking for a billion tokens stops where the model must."""
    room = (info.context or 0) - len(seq.ids)
    if info.context and seq.params.max_tokens > room:
        seq.params = dataclasses.replace(seq.params, max_tokens=max(room, 1))
        seq.capped = True
    return seq


def _row_error(e: Exception) -> RowError:
    return RowError("generate", f"{type(e).__name__}: {short(e, 300) or type(e).__name__}")

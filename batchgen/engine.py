"""Generate stage: loads models, builds prompts, and runs rows (mlx-lm for text, mlx-vlm for media).

With decoder.py, the only place that talks to MLX. Rows are first planned (tokenized, their
lane chosen), then run in batches through the decoder, or one by one through mlx-vlm's
own generate for inputs the decoder does not handle (video, audio, other model families).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache import Memo, PrefixCache
from .decoder import LMAdapter, Sequence, VLMAdapter, decode_batch, final_text, hit_stop
from .draft import Drafter, drafted_from_flags, load_text_drafter, load_vision_drafter
from .errors import ConfigError, RowError
from .records import Generation, GenParams, Job

__all__ = ["ModelInfo", "Media", "Plan", "Engines", "inspect_model", "is_multimodal"]

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
    context: int | None = None  # max_position_embeddings, where the config says

    @property
    def multimodal(self) -> bool:
        return self.vision or self.audio


@dataclass(slots=True)
class Media:
    """A row's decoded media, in part order per kind."""

    images: list[Any] = field(default_factory=list)  # PIL images
    videos: list[Any] = field(default_factory=list)  # (T, H, W, 3) uint8 arrays
    audio: list[str] = field(default_factory=list)  # local file paths
    image_digests: list[str] = field(default_factory=list)  # content digest of each image

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
    text = config.get("text_config") or {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return ModelInfo(
        name, path, vision=vision, audio=audio, video=vision and _has(config, _VIDEO_KEYS), context=context
    )


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


def _collect(stream: Iterator[Any], p: GenParams, tokenizer: Any, eos: set[int]) -> Generation:
    """Drain an engine's stream of responses into a Generation: text decoded from the tokens
    (as the batched decoder does), stop strings checked on a bounded tail, counts from the
    engine's last response; `length` only when the token budget ran out."""
    tokens: list[int] = []
    last = None
    stopped = False
    for last in stream:
        final_ids = getattr(last, "token_ids", None)
        if final_ids is not None:  # mlx-vlm's closing response lists them all (and repeats the last)
            tokens = [int(t) for t in final_ids]
            continue
        if last.token is None:
            continue
        tokens.append(int(last.token.item() if hasattr(last.token, "item") else last.token))
        if p.stop and hit_stop(tokens, p.stop, tokenizer.decode):
            stopped = True
            break
    if last is None:
        return Generation("", "length", 0, 0)
    completion = len(tokens)
    ended = stopped or (tokens and tokens[-1] in eos) or completion < p.max_tokens
    return Generation(
        text=final_text(tokens, eos, p.stop, tokenizer.decode),
        finish_reason="stop" if ended else "length",
        prompt_tokens=int(last.prompt_tokens),
        completion_tokens=completion,
        cached_tokens=int(getattr(last, "cached_tokens", 0) or 0),
    )


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
    ):
        self.vision_info = inspect_model(model)
        self.text_info = inspect_model(text_model) if text_model else self.vision_info
        self.prefixes = prefix_cache
        self.drafter = drafter
        self._vlm: tuple[Any, Any] | None = None
        self._lm: tuple[Any, Any] | None = None
        self._text_on_vlm = False
        self._features: Memo[Any] = Memo(64)  # vision-tower outputs by image digests

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
                    return Plan(job, media, "draft")
                return self._plan_lm(job, media)
            model, _ = self._load_vlm()
            batchable = model.config.model_type in _DECODER_FAMILIES and not media.videos and not media.audio
            if self.drafter is not None and self.drafter.lane == "vlm":
                batchable = False  # the drafter runs inside mlx-vlm's generate, one row at a time
            return self._plan_vlm(job, media) if batchable else Plan(job, media, "single")
        except RowError:
            raise
        except Exception as e:  # a template or processor that rejects this row
            raise _row_error(e) from e

    def _plan_lm(self, job: Job, media: Media) -> Plan:
        model, tokenizer = self._lm  # type: ignore[misc]
        p = job.params
        messages = _text_only(job.messages)
        if getattr(tokenizer, "chat_template", None):
            prompt = _apply_template(tokenizer, messages, p.chat_template_kwargs)
        else:  # base models: the turns' text, one per line
            prompt = "\n".join(m["content"] for m in messages)
        _check_length(prompt, None, self.text_info)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        _check_length(prompt, ids, self.text_info)
        bounds = _message_bounds(tokenizer, messages, p.chat_template_kwargs, ids)
        seq = Sequence(ids=ids, params=p, boundaries=self._keys("lm", ids, bounds, []))
        return Plan(job, media, "lm", seq, group=("lm", tuple(ids[: bounds[-1]]) if bounds else ()))

    def _plan_vlm(self, job: Job, media: Media) -> Plan:
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        model, processor = self._vlm  # type: ignore[misc]
        p = job.params
        messages = _template_parts(job.messages) if media else _text_only(job.messages)
        prompt = _apply_template(processor, messages, p.chat_template_kwargs)
        _check_length(prompt, None, self.vision_info)
        inputs = prepare_inputs(
            processor,
            images=media.images or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
        )
        input_ids = inputs["input_ids"]
        ids = input_ids[0].tolist()
        _check_length(prompt, ids, self.vision_info)
        lm = model.language_model
        grid = inputs.get("image_grid_thw")
        if media.images:
            positions, delta = lm.get_rope_index(input_ids, grid, None, inputs.get("attention_mask"))
            delta = int(delta.reshape(-1)[0].item())
        else:
            positions, delta = mx.broadcast_to(mx.arange(len(ids)).reshape(1, 1, -1), (3, 1, len(ids))), 0
        start_id = getattr(model.config, "vision_start_token_id", None)
        media_starts = [i for i, t in enumerate(ids) if t == start_id]
        bounds = sorted({*media_starts, *(_after_media(ids, model.config) if media.images else [])})
        digests = list(media.image_digests)
        embed = self._embedder(model, inputs, ids, digests) if media.images else None
        keyed = self._keys("vlm", ids, bounds, [(s, d) for s, d in zip(media_starts, digests, strict=False)])
        seq = Sequence(ids=ids, params=p, boundaries=keyed, embed=embed, positions=positions, delta=delta)
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
    def run(self, plans: list[Plan]) -> list[Generation | RowError]:
        """One batch of plans of one lane; each row gets its Generation or its RowError."""
        lane = plans[0].lane
        if lane == "single":
            return [self._guard(self._generate_vlm, plan) for plan in plans]
        if lane == "draft":
            return [self._guard(self._generate_draft_lm, plan) for plan in plans]
        if lane == "lm":
            model, tokenizer = self._lm  # type: ignore[misc]
            adapter, eos = LMAdapter(model), set(tokenizer.eos_token_ids)
        else:
            model, processor = self._vlm  # type: ignore[misc]
            tokenizer = getattr(processor, "tokenizer", processor)
            tokenizer.stopping_criteria.reset(model.config.eos_token_id)
            adapter, eos = VLMAdapter(model), set(tokenizer.stopping_criteria.eos_token_ids)
        seqs = [plan.seq for plan in plans]
        try:
            decode_batch(adapter, seqs, eos, tokenizer.decode, self.prefixes)  # type: ignore[arg-type]
        except Exception as e:  # an engine error fails these rows, not the run
            if len(plans) == 1:
                return [_row_error(e)]
            return [r for plan in plans for r in self.run([_fresh(plan)])]  # find the culprit
        return [
            Generation(s.text, s.finish_reason, len(s.ids), len(s.tokens), s.cached_tokens)
            for s in seqs  # type: ignore[union-attr]
        ]

    @staticmethod
    def _guard(fn, plan: Plan) -> Generation | RowError:
        try:
            return fn(plan.job, plan.media)
        except RowError as e:
            return e
        except Exception as e:
            return _row_error(e)

    def _generate_draft_lm(self, job: Job, media: Media) -> Generation:
        """mlx-lm's speculative loop with the text draft model; counts replayed from its flags."""
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        model, tokenizer = self._lm  # type: ignore[misc]
        d, p = self.drafter, job.params
        plan = self._plan_lm(job, media)
        if p.seed is not None:
            mx.random.seed(p.seed)
        flags: list[bool] = []

        def stream():
            for response in stream_generate(
                model, tokenizer, plan.seq.ids, max_tokens=p.max_tokens,  # type: ignore[union-attr]
                draft_model=d.model, num_draft_tokens=d.num_draft_tokens,  # type: ignore[union-attr]
                sampler=make_sampler(p.temperature, p.top_p if p.top_p < 1 else 0.0, p.min_p, top_k=p.top_k),
                logits_processors=make_logits_processors(
                    repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
                    presence_penalty=p.presence_penalty or None,
                ),
            ):  # fmt: skip
                flags.append(bool(response.from_draft))
                yield response

        gen = _collect(stream(), p, tokenizer, set(tokenizer.eos_token_ids))
        gen.prompt_tokens = len(plan.seq.ids)  # type: ignore[union-attr]
        gen.mtp_accepted = sum(flags)
        gen.mtp_drafts = drafted_from_flags(flags, p.max_tokens, d.num_draft_tokens)  # type: ignore[union-attr]
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

    def _generate_vlm(self, job: Job, media: Media) -> Generation:  # noqa: C901
        """mlx-vlm's own generate, one row: video, audio and families the decoder does not know."""
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
        if p.seed is not None:
            import mlx.core as mx

            mx.random.seed(p.seed)
        draft: dict[str, Any] = {}
        d = self.drafter
        if d is not None and d.lane == "vlm":
            from mlx_vlm.speculative.common import speculative_stats_since, speculative_stats_snapshot

            self.load_drafter()
            draft = {"draft_model": d.model, "draft_kind": d.kind}
            if d.block_size is not None:
                draft["draft_block_size"] = d.block_size
            snapshot = speculative_stats_snapshot(d.model)
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
            **draft,
        )
        gen = _collect(stream, p, tokenizer, set(tokenizer.stopping_criteria.eos_token_ids))
        if draft:
            stream.close()  # a stop string ends the stream early: let it settle its counters
            _, accepted, drafted = speculative_stats_since(d.model, snapshot)  # type: ignore[union-attr]
            gen.mtp_accepted, gen.mtp_drafts = accepted or 0, drafted or 0
        return gen


_DECODER_FAMILIES = {"qwen2_vl", "qwen2_5_vl"}  # mRoPE models whose language model takes position ids


def _check_length(prompt: str, ids: list[int] | None, info: ModelInfo) -> None:
    """A prompt longer than the model's context is a row error; an absurdly long one is
    refused from its characters, before it costs a tokenization."""
    limit = info.context
    if not limit:
        return
    if ids is None and len(prompt) > limit * 16:  # no tokenizer averages 16 characters a token
        raise RowError(
            "generate", f"prompt of {len(prompt)} characters cannot fit the model's context of {limit} tokens"
        )
    if ids is not None and len(ids) >= limit:
        raise RowError("generate", f"prompt of {len(ids)} tokens does not fit the model's context of {limit}")


def _dtype(model: Any):
    return model.vision_tower.patch_embed.proj.weight.dtype


def _after_media(ids: list[int], config: Any) -> list[int]:
    """Positions just past each media block: the prefix every question on that image shares."""
    end_id = getattr(config, "vision_end_token_id", None)
    if end_id is None:
        end_id = getattr(config, "vision_start_token_id", -2) + 1
    return [i + 1 for i, t in enumerate(ids) if t == end_id]


def _message_bounds(tokenizer: Any, messages: list[dict], kwargs: dict, ids: list[int]) -> list[int]:
    """Where each turn but the last ends in the prompt's tokens: a shared system prompt or
    few-shot turns are a prefix that other rows reuse. Turns whose rendering is not a clean
    token prefix of the whole (a template that rewrites history) give no boundary."""
    bounds = []
    for k in range(1, len(messages)):
        try:
            head = tokenizer.apply_chat_template(
                messages[:k], tokenize=False, add_generation_prompt=False, **kwargs
            )
        except Exception:
            break
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        if 0 < len(head_ids) < len(ids) and ids[: len(head_ids)] == head_ids:
            bounds.append(len(head_ids))
    return bounds


def _fresh(plan: Plan) -> Plan:
    """The same plan with cleared outputs, to run again on its own."""
    s = plan.seq
    seq = Sequence(s.ids, s.params, s.boundaries, s.embed, s.positions, s.delta)  # type: ignore[union-attr]
    return Plan(plan.job, plan.media, plan.lane, seq, plan.group)


def _row_error(e: Exception) -> RowError:
    message = " ".join(str(e).split()) or type(e).__name__
    return RowError("generate", f"{type(e).__name__}: {message[:300]}")

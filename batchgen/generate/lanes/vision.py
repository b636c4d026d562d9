"""The batched mlx-vlm lanes: media rows' prompts, prefixes that never split an image, embeddings.

A media row's prompt is rendered and expanded as its checkpoint's processor does it, and
embeddings are made only for the slices that hold media.
- `VisionLane`: Qwen2/2.5/3-VL (and MoE) and Qwen3.5 image or video rows: explicit (mRoPE)
  positions, vision features reused across rows;
- `OffsetVisionLane`: image rows of the families positioned by their cache offsets (llava,
  LLaVA-NeXT, SmolVLM, Idefics3, Gemma 3 and 4, Mistral 3, InternVL).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import mlx.core as mx

from ...core.errors import RowError
from ...core.families import family
from ...core.memo import Memo
from ...core.records import Job, Media
from ..base.arrays import Model, Processor, Tokenizer, int_rows
from ..base.aside import at_home, settle
from ..chat.prompts import after_media, check_length, render, template_parts, text_only
from ..decode.adapters import OffsetVLMAdapter, Sequence, VLMAdapter
from .batched import BatchedLane, Plan

__all__ = ["VisionLane", "OffsetVisionLane"]


class _MediaLane(BatchedLane):
    """Batched mlx-vlm lanes: the row's prompt as the checkpoint's processor renders and
    expands it, decoded by the lane's adapter."""

    adapter: type[VLMAdapter] = VLMAdapter

    def _inputs(self, job: Job, media: Media) -> tuple[Model, Processor, dict, list[int]]:
        """(model, processor, the processor's inputs, the prompt's token ids)."""
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        model, processor = self.models.vlm()
        messages = template_parts(job.messages) if media else text_only(job.messages)
        prompt = render(processor, messages, job.params, self.models.traits(vision=True).markers)
        check_length(prompt, None, self.info)
        inputs = prepare_inputs(
            processor,
            images=media.images or None,
            videos=media.videos or None,
            prompts=prompt,
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
        )
        settle(*(v for v in inputs.values() if isinstance(v, mx.array)))
        ids = inputs["input_ids"][0].tolist()
        check_length(prompt, ids, self.info)
        return model, processor, inputs, ids

    def _decoding(self):
        model, processor = self.models.vlm()
        tokenizer = getattr(processor, "tokenizer", processor)
        tokenizer.stopping_criteria.reset(model.config.eos_token_id)
        return (
            self.adapter(model),
            set(tokenizer.stopping_criteria.eos_token_ids),
            tokenizer.decode,
            self.models.traits(vision=True),
        )


class VisionLane(_MediaLane):
    """Qwen-VL families (and Qwen3.5, whose linear-attention caches batch too): the language
    model takes explicit (mRoPE) position ids; Qwen3-VL also takes DeepStack features."""

    name = "vlm"

    @cached_property
    def _features(self) -> Memo[mx.array]:
        """Vision-tower outputs by image digests."""
        return Memo(64)

    @cached_property
    def _layouts(self) -> Memo[tuple[mx.array, int]]:
        """mRoPE positions up to the last media."""
        return Memo(64)

    def plan(self, job: Job, media: Media) -> Plan:
        model, _, inputs, ids = self._inputs(job, media)
        p = job.params
        lm = model.language_model
        image_grid, video_grid = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
        ends = after_media(ids, model.config) if media else []
        visual = bool(media.images or media.videos)
        last = max(ends, default=len(ids) if visual else 0)
        head, top = mx.zeros((3, 1, 0), dtype=mx.int32), 0
        if visual:
            # The positions up to the last media block are those of every prompt laid out alike
            # (a question after a shared image): computed once per layout; text after it counts on.
            head, top = self._layouts.get(
                (tuple(ids[:last]), _listed(image_grid), _listed(video_grid)),
                lambda: _head(lm, inputs, last),
            )
        tail = mx.arange(top, top + len(ids) - last, dtype=head.dtype).reshape(1, 1, -1)
        positions = mx.concatenate([head, mx.broadcast_to(tail, (3, 1, len(ids) - last))], axis=2)
        settle(positions)
        delta = top - last  # generated token n sits at len(ids) + n + delta
        start_id = getattr(model.config, "vision_start_token_id", None)
        media_starts = [i for i, t in enumerate(ids) if t == start_id]
        bounds = sorted({*media_starts, *ends})
        digests = [m.digest for m in media.items if m.kind != "audio"]  # in slot order: images and a video
        embed = self._embedding(model, inputs, ids, digests)
        keyed = self._keys(ids, bounds, [(s, d) for s, d in zip(media_starts, digests, strict=False)])
        seq = Sequence(ids=ids, params=p, boundaries=keyed, embed=embed, positions=positions, delta=delta)
        group = (tuple(digests), tuple(ids[: media_starts[0]]) if media_starts else ())
        return Plan(job, media, self, self._fit(seq, self.models.traits(vision=True)), group=group)

    def _embedding(self, model: Model, inputs: dict, ids: list[int], digests: list[str]) -> Any:
        """How the row's prompt is embedded (a media row's slices; None: the model embeds ids)."""
        return self._embedder(model, inputs, ids, digests) if digests else None

    def _embedder(self, model: Model, inputs: dict, ids: list[int], digests: list[str]):
        """Embeddings of any slice of the prompt; the vision tower runs only when a slice
        holds image or video tokens, and once per set of images or video (a row's images and
        its video together where the family takes both: Qwen3-VL, whose features are not kept)."""
        full: list[Any] = []
        media_ids = {model.config.image_token_id, getattr(model.config, "video_token_id", None)}
        lm = model.language_model
        deepstack = family(model.config.model_type).deepstack

        def embed(a: int, b: int):
            if not media_ids.intersection(ids[a:b]):
                return lm.model.embed_tokens(mx.array(ids[a:b])[None])
            if not full:
                kinds = [(kind, key) for kind, key in _PIXELS if inputs.get(key) is not None]
                given: dict[str, Any] = {}
                for kind, key in kinds:
                    given |= {key: inputs[key], f"{kind}_grid_thw": inputs[f"{kind}_grid_thw"]}
                if not deepstack:  # one kind a row here (Router.route)
                    (kind, key), *_ = kinds
                    pixels, grid = inputs[key], inputs[f"{kind}_grid_thw"]
                    dtype = model.vision_tower.patch_embed.proj.weight.dtype
                    given["cached_image_features"] = self._features.get(  # an adapter may reach the tower
                        (self.models.applied, kind, *digests),
                        lambda: _tower(model, pixels.astype(dtype), grid),
                    )
                out = model.get_input_embeddings(
                    inputs["input_ids"], mask=inputs.get("attention_mask"), **given
                )
                # DeepStack features come from the tower's own run (not from cached features); the
                # language model aligns them with each slice it is given, by its cache offset.
                extra = {k: getattr(out, k, None) for k in ("visual_pos_masks", "deepstack_visual_embeds")}
                full.append(
                    (out.inputs_embeds, {k: v for k, v in extra.items() if v is not None and deepstack})
                )
            embeds, extra = full[0]
            return (embeds[:, a:b], extra) if extra else embeds[:, a:b]

        return embed


_PIXELS = (("image", "pixel_values"), ("video", "pixel_values_videos"))  # a processor's pixels, by kind


def _head(lm: Model, inputs: dict, last: int) -> tuple[mx.array, int]:
    """The model's own mRoPE positions of a prompt's first `last` tokens (up to the end of its
    last media block), and the position the next token takes."""
    mask = inputs.get("attention_mask")
    mask = None if mask is None else mask[:, :last]
    grids = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    positions, _ = lm.get_rope_index(inputs["input_ids"][:, :last], *grids, mask)
    return positions, int(positions.max().item()) + 1


def _listed(grid: mx.array | None) -> tuple | None:
    return None if grid is None else tuple(map(tuple, int_rows(grid)))


def _tower(model: Model, pixels: mx.array, grid: mx.array) -> mx.array:
    """The vision tower's features; Qwen3.5's tower also returns what only its drafters use."""
    out = model.vision_tower(pixels, grid)
    return out[0] if isinstance(out, tuple) else out


def media_blocks(ids: list[int], image_id: int, specials: set[int], gap: int = 4) -> list[tuple[int, int]]:
    """(start, end) of each image's tokens in a prompt: runs of the image token, joined across
    a few special tokens between them (Pixtral's row breaks, a tile's markers), so that no
    prefix boundary falls inside an image."""
    blocks: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != image_id:
            continue
        if blocks and blocks[-1][1] == i:
            blocks[-1] = (blocks[-1][0], i + 1)
        elif blocks and i - blocks[-1][1] <= gap and all(x in specials for x in ids[blocks[-1][1] : i]):
            blocks[-1] = (blocks[-1][0], i + 1)
        else:
            blocks.append((i, i + 1))
    return blocks


class OffsetVisionLane(_MediaLane):
    """Image rows of families whose language model takes positions from the cache offsets:
    batched, with prefix reuse; a prefix never ends inside an image's tokens."""

    name = "vlm-offset"
    adapter = OffsetVLMAdapter
    # mlx-vlm 0.7.10's llava_next puts a whole tile's features at each of the processor's image
    # tokens and keeps what fits: the language model sees a longer prompt than the token ids.

    def plan(self, job: Job, media: Media) -> Plan:
        model, processor, inputs, ids = self._inputs(job, media)
        p = job.params
        image_id = getattr(model.config, "image_token_index", None) or model.config.image_token_id
        merged = None
        if media.images and family(model.config.model_type).first_image_only:
            at_home("LLaVA-NeXT's merged embeddings (a lazy graph, run only if a slice needs it)")
            merged = _merged(model, inputs)  # a lazy graph: the tower runs only if a slice needs it
            ids = _relaid(ids, image_id, merged[0].shape[1])
            check_length("", ids, self.info)
        tokenizer: Tokenizer = getattr(processor, "tokenizer", processor)
        blocks = media_blocks(ids, image_id, {*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder})
        starts, ends = [a for a, _ in blocks], [b for _, b in blocks]
        digests = media.digests("image")
        # Adjacent images can make one block: then every image keys from the first one's start.
        owners = starts if len(starts) == len(digests) else [starts[0]] * len(digests) if starts else []
        keyed = self._keys(ids, sorted({*starts, *ends}), list(zip(owners, digests, strict=True)))
        embed = self._embedder(model, inputs, ids, image_id, merged) if media.images else None
        seq = Sequence(ids=ids, params=p, boundaries=keyed, embed=embed)
        group = (tuple(digests), tuple(ids[: starts[0]]) if starts else ())
        return Plan(job, media, self, self._fit(seq, self.models.traits(vision=True)), group=group)

    @staticmethod
    def _embedder(model: Model, inputs: dict, ids: list[int], image_id: int, merged: tuple | None = None):
        """Merged embeddings of a slice holding image tokens (computed once for the row);
        None for other slices, which the model embeds itself."""
        full: list[Any] = [] if merged is None else [merged]

        def embed(a: int, b: int):
            if image_id not in ids[a:b]:
                return None
            if not full:
                full.append(_merged(model, inputs))
            embeds, per_layer = full[0]
            return (
                embeds[:, a:b]
                if per_layer is None
                else (embeds[:, a:b], {"per_layer_inputs": per_layer[:, a:b]})
            )

        return embed


def _merged(model: Model, inputs: dict) -> tuple[Any, Any]:
    """The prompt's embeddings with the image features merged in, as mlx-vlm's generate makes
    them, and Gemma 4's per-layer inputs (made from the ids with media tokens blanked)."""
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    out = model.get_input_embeddings(
        inputs["input_ids"], inputs["pixel_values"], mask=inputs.get("attention_mask"), **extra
    )
    return out.inputs_embeds, getattr(out, "per_layer_inputs", None)


def _relaid(ids: list[int], image_id: int, length: int) -> list[int]:
    """Token ids laid out as the language model sees them when the merged embeddings are
    `length` long: the image's run of tokens widened (or narrowed) to the features'."""
    at = [i for i, t in enumerate(ids) if t == image_id]
    if not at or at[-1] - at[0] + 1 != len(at):
        raise RowError("generate", "a llava_next prompt takes one image")
    return ids[: at[0]] + [image_id] * (length - len(ids) + len(at)) + ids[at[-1] + 1 :]

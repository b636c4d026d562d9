"""Each model family's facts in one record: its lane, its reuse, why it runs alone, its tiny build.

The router, the tiny builders and the README's table (checked by a test) read them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Family", "FAMILIES", "BIDIRECTIONAL", "family"]

# Why a family's rows cannot batch: padding and prefix snapshots would change their results.
BIDIRECTIONAL = (
    "its image tokens attend both ways (use_bidirectional_attention: vision), so padding "
    "and prefix snapshots change results"
)


@dataclass(frozen=True, slots=True)
class Family:
    """A model family (`model_type` in a checkpoint's config)."""

    model_type: str
    lane: Literal["mrope", "offset", "single"]  # batched with mRoPE positions, by cache offsets, or alone
    deepstack: bool = False  # vision features also feed early layers: prefixes reused, not features
    # mlx-vlm lays the first image's features over the prompt: ids relaid, a row of several refused
    first_image_only: bool = False
    # mRoPE: mlx-vlm's model embeds images and a video in one prompt (else a row of both is refused)
    images_with_video: bool = False
    why_unbatched: str | None = None  # lane "single": the summary's reason
    # rows with an MTP drafter batch in mlx-vlm's rounds (checked equal to the target alone)
    drafts_batch: bool = False
    tiny: str | None = None  # `batchgen make-tiny-model --kind` that builds one

    @property
    def video_batches(self) -> bool:
        return self.lane == "mrope"  # a clip's prefix shared by its questions


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2_vl", "mrope", tiny="vlm"),
        Family("qwen2_5_vl", "mrope", tiny="qwen2_5_vl"),
        Family("qwen3_vl", "mrope", deepstack=True, images_with_video=True, tiny="qwen3_vl"),
        Family("qwen3_vl_moe", "mrope", deepstack=True, tiny="qwen3_vl_moe"),
        Family("qwen3_5", "mrope", drafts_batch=True, tiny="mtp-pair"),
        Family("llava", "offset", tiny="llava"),
        Family("llava_next", "offset", first_image_only=True, tiny="llava_next"),
        Family("smolvlm", "offset", tiny="smolvlm"),
        Family("idefics3", "offset", tiny="idefics3"),
        Family("gemma3", "offset", tiny="gemma3"),
        Family("gemma4", "offset", tiny="gemma4"),
        Family("mistral3", "offset", tiny="mistral3"),
        Family("internvl_chat", "offset", tiny="internvl_chat"),
        Family(
            "paligemma",
            "single",
            why_unbatched="its prompt prefix attends both ways, so padding and "
            "prefix snapshots change results",
        ),
    )
}


def family(model_type: str) -> Family:
    """The family of a checkpoint; one not in the table runs its rows one at a time."""
    unknown = Family(model_type, "single", why_unbatched="no batched lane for this family yet")
    return FAMILIES.get(model_type) or unknown

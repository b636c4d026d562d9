"""Tiny checkpoints built offline: a BPE tokenizer and random qwen2 / qwen2_vl weights.

No model can be downloaded in CI or on an air-gapped box, so tests and the sample run use
these. They are real architectures saved the way Hugging Face checkpoints are, so the
ordinary loaders (`mlx_lm.load`, `mlx_vlm.load`) are the code path exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...core.families import FAMILIES
from . import families
from .parts import (
    CHANNEL_TEMPLATE,
    CHANNEL_TOKENS,
    CHANNEL_WORDS,
    CHAT_TEMPLATE,
    THINK_TOKENS,
    THINKING_TEMPLATE,
    TOOL_WORDS,
    build_tokenizer,
    build_vlm,
    store,
    text_config,
    token_ids,
    write_generation_config,
    write_json,
)

__all__ = ["KINDS", "make_tiny_model"]


# A text model, its draft, and one checkpoint of every family the table names one for.
KINDS = ("lm", "text-draft", "thinking-lm", "channel-lm", *(f.tiny for f in FAMILIES.values() if f.tiny))


# Text models whose tokenizer and template know <think> (Qwen3's), or Gemma 4's channel markers.
_MARKED = {
    "thinking-lm": (THINK_TOKENS, THINKING_TEMPLATE, TOOL_WORDS),
    "channel-lm": (CHANNEL_TOKENS, CHANNEL_TEMPLATE, CHANNEL_WORDS),
}


def make_tiny_model(
    out_dir: str | Path,
    kind: str = "vlm",  # one of KINDS
    seed: int = 0,
    image_size: int = 56,
    hidden: int | None = None,
    layers: int | None = None,
    vision_embed: int = 64,
    sensitive: bool = False,
    bits: int | None = None,
) -> Path:
    """Write a loadable tiny checkpoint to `out_dir`, deterministic for a given seed.

    `kind="lm"` is a qwen2 text model (hidden 128, 4 layers) for mlx-lm;
    `kind="vlm"` is a qwen2_vl model (hidden 64, 2 layers, vision depth 2) for mlx-vlm seeing
    `image_size`² pixels (4 image tokens at 56); "qwen2_5_vl" with Qwen2.5-VL's windowed tower.
    Benchmarks pass larger `hidden`, `layers` and `vision_embed` so prefill costs something.
    `kind="text-draft"` is a smaller qwen2 with the same tokenizer, a draft model for "lm";
    `kind="thinking-lm"` the "lm" with Qwen3's `<think>` markers and `enable_thinking` template;
    `kind="channel-lm"` the "lm" with Gemma 4's multi-token `<|channel>thought` … `<channel|>`;
    `kind="mtp-pair"` writes `out_dir/target` (a tiny qwen3_5 VLM whose weights also embed
    its `mtp.*` head) and `out_dir/drafter` (the same head as a standalone qwen3_5_mtp drafter).
    `kind="llava"` is a llava (llama text, CLIP vision, 16 tokens per 32² image) whose processor
    is mlx-vlm's LlavaProcessor; `kind="smolvlm"` a SmolVLM (llama text, SigLIP-like vision,
    pixel shuffle to 4 tokens per 32² image, no image splitting); `kind="gemma3"` a Gemma 3
    (sliding-window layers, SigLIP vision pooled to 4 tokens).
    `bits` (4, 8) quantizes the language model the way mlx-community checkpoints are made
    (`mlx_vlm convert -q`, group size 32); the vision tower stays in float.
    `sensitive` scales the language layers (x3) and the vision merger (x4): random weights
    otherwise repeat one token whatever they see, which hides position and image-order bugs
    from a differential test.
    """
    import mlx.core as mx

    out = Path(out_dir)
    if bits is not None:
        shape = {"image_size": image_size, "hidden": hidden, "layers": layers, "vision_embed": vision_embed}
        return _quantized(out, bits, kind=kind, seed=seed, sensitive=sensitive, **shape)
    if kind == "mtp-pair":
        return families.make_mtp_pair(out, seed, sensitive)
    if kind in families.VISION_KINDS:
        return families.make_vision_family(out, kind, seed, sensitive, hidden or 64)
    extra, template, words = _MARKED.get(kind, ((), CHAT_TEMPLATE, ()))
    vocab = build_tokenizer(out, extra=extra, template=template, words=words)  # drafts pair with "lm" targets
    ids = token_ids(out)
    mx.random.seed(seed)
    if kind == "text-draft":
        kind, hidden, layers = "lm", hidden or 64, layers or 2
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        return families.make_qwen3_vl(out, vocab, ids, sensitive, moe=kind == "qwen3_vl_moe")
    if kind in ("lm", "thinking-lm", "channel-lm"):
        model, config = _qwen2(vocab, ids, hidden or 128, layers or 4)
    elif kind in ("vlm", "qwen2_5_vl"):
        model, config = _qwen2_vl(kind == "qwen2_5_vl", vocab, ids, hidden or 64, layers or 2, vision_embed)
        _qwen2_vl_processor(out, image_size)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (expected one of {', '.join(KINDS)})")
    store(model, config, out, sensitive)
    write_generation_config(out, ids)
    return out


def _qwen2(vocab: int, ids: dict[str, int], hidden: int, layers: int) -> tuple[Any, dict[str, Any]]:
    """A qwen2 text model and its config, for mlx-lm."""
    from mlx_lm.models import qwen2

    config: dict[str, Any] = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    config.update(text_config(vocab, ids, hidden=hidden, layers=layers, heads=4))
    return qwen2.Model(qwen2.ModelArgs.from_dict(config)), config


def _qwen2_vl(
    qwen2_5: bool, vocab: int, ids: dict[str, int], hidden: int, layers: int, vision_embed: int
) -> tuple[Any, dict[str, Any]]:
    """A qwen2_vl model and its config (qwen2_5: Qwen2.5-VL's windowed vision tower)."""
    from mlx_vlm.models import qwen2_vl

    text = text_config(vocab, ids, hidden=hidden, layers=layers, heads=4)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # mRoPE sections must add up to half the head dim.
    section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]
    text["rope_scaling"] = {"type": "mrope", "mrope_section": section}
    config: dict[str, Any] = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **text,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": vision_embed,
            "hidden_size": text["hidden_size"],
            "num_heads": 2,
            # transformers validates config.json strictly: an int, not 2.0.
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    if qwen2_5:  # windowed vision attention, full attention in its last block
        config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
        config["vision_config"] = {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": vision_embed,
            "intermediate_size": vision_embed * 2,
            "out_hidden_size": text["hidden_size"],
            "num_heads": 2,
            "patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        }
        return build_vlm(config), config
    # Build the config objects the way mlx_vlm.load does, so what we save is what it loads.
    model_config = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    return qwen2_vl.Model(model_config), config


def _qwen2_vl_processor(out: Path, image_size: int) -> None:
    """The processor's files: `image_size`² pixels an image, the chat template."""
    pixels = image_size * image_size
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "min_pixels": pixels,
            "max_pixels": pixels,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    )
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def _quantized(out: Path, bits: int, **build) -> Path:
    import shutil
    import tempfile

    from mlx_vlm import convert

    if build["kind"] in ("lm", "text-draft", "mtp-pair"):
        raise ValueError("only the single-checkpoint vision kinds are quantized here")
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(Path(tmp) / "float", **build)
        shutil.rmtree(out, ignore_errors=True)
        convert(str(source), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=32)
    return out

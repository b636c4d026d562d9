"""Tiny checkpoints of the other model families, built as the qwen2 ones are.

Qwen3-VL and its MoE, Qwen3.5 with its MTP drafter, llava, LLaVA-NeXT, SmolVLM, Idefics3, Gemma
3, Gemma 4, Mistral 3 and InternVL, built the way `tiny.make_tiny_model` builds the qwen2 ones
(tiny_parts.py): a local tokenizer with the family's special tokens, random weights from mlx-
vlm's own model classes, the family's processor files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .parts import (
    CHAT_TEMPLATE,
    build_tokenizer,
    build_vlm,
    sharpen,
    store,
    text_config,
    token_ids,
    write_generation_config,
    write_json,
)

__all__ = ["VISION_KINDS", "make_qwen3_vl", "make_vision_family", "make_mtp_pair"]


_GEMMA4_IMAGES = {"patch_size": 8, "max_soft_tokens": 4, "pooling_kernel_size": 2, "do_normalize": True,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
# Per family: special tokens, vision config, top-level config, processor files (32² images, patch 8).
_VISION: dict[str, tuple[tuple[str, ...], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "llava": (
        ("<image>",),
        {"model_type": "clip_vision_model", "projection_dim": 32},
        {"image_token_index": "<image>", "vision_feature_select_strategy": "default",
         "vision_feature_layer": -2, "projector_hidden_act": "gelu"},
        {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
         "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, "do_center_crop": True,
         "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711]},
        {"processor_class": "LlavaProcessor", "patch_size": 8, "image_token": "<image>",
         "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
    ),
    "llava_next": (  # one 32² tile (the grid's only pinpoint) plus the base image, rows ended by a newline
        ("<image>",),
        {"model_type": "clip_vision_model", "projection_dim": 32},
        {"image_token_index": "<image>", "vision_feature_select_strategy": "default",
         "vision_feature_layer": -2, "projector_hidden_act": "gelu", "image_grid_pinpoints": [[32, 32]]},
        {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
         "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, "do_center_crop": True,
         "image_grid_pinpoints": [[32, 32]], "do_pad": True,
         "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711]},
        {"processor_class": "LlavaNextProcessor", "patch_size": 8, "image_token": "<image>",
         "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
    ),
    "smolvlm": (
        ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"),
        {"model_type": "smolvlm_vision"},
        {"image_token_id": "<image>", "scale_factor": 2},
        {"image_processor_type": "Idefics3ImageProcessor", "processor_class": "SmolVLMProcessor",
         "do_image_splitting": False, "size": {"longest_edge": 32}, "max_image_size": {"longest_edge": 32},
         "do_pad": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"processor_class": "SmolVLMProcessor", "image_seq_len": 4},
    ),
    "idefics3": (  # SmolVLM's ancestor: the same tower and connector, its own processor
        ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"),
        {"model_type": "idefics3_vision"},
        {"image_token_id": "<image>", "scale_factor": 2},
        {"image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
         "do_image_splitting": False, "size": {"longest_edge": 32}, "max_image_size": {"longest_edge": 32},
         "do_pad": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"processor_class": "Idefics3Processor", "image_seq_len": 4},
    ),
    "gemma3": (  # the processor reads image_token / boi_token / eoi_token from the tokenizer
        ("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
        {"model_type": "siglip_vision_model"},
        {"image_token_index": "<image_soft_token>", "hidden_size": 64, "pad_token_id": "<|endoftext|>",
         "mm_tokens_per_image": 4},
        {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
         "size": {"height": 32, "width": 32}, "do_pan_and_scan": False, "image_mean": [0.5, 0.5, 0.5],
         "image_std": [0.5, 0.5, 0.5]},
        {"processor_class": "Gemma3Processor", "image_seq_length": 4},
    ),
    "gemma4": (  # soft tokens pooled 2x2 from 8-pixel patches, at most 4 an image; no audio tower
        ("<|image|>", "<|boi|>", "<|eoi|>", "<|audio|>", "<|boa|>", "<|eoa|>", "<|video|>"),
        {"model_type": "gemma4_vision", "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
         "pooling_kernel_size": 2, "position_embedding_size": 64, "default_output_length": 4},
        {"image_token_id": "<|image|>", "boi_token_id": "<|boi|>", "eoi_token_id": "<|eoi|>",
         "audio_token_id": "<|audio|>", "video_token_id": "<|video|>", "hidden_size": 64,
         "vision_soft_tokens_per_image": 4, "audio_config": None},
        {"image_processor": _GEMMA4_IMAGES},
        {"image_processor": _GEMMA4_IMAGES},
    ),
    "mistral3": (  # Pixtral vision: [IMG] tokens in rows ended by [IMG_BREAK], then [IMG_END]
        ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
        {"model_type": "pixtral", "head_dim": 16, "rope_theta": 10000.0},
        {"image_token_index": "[IMG]", "spatial_merge_size": 2, "vision_feature_layer": -1,
         "multimodal_projector_bias": False},
        {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
         "size": {"longest_edge": 32}, "patch_size": {"height": 8, "width": 8},
         "image_mean": [0.48145466, 0.4578275, 0.40821073],
         "image_std": [0.26862954, 0.26130258, 0.27577711]},
        {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2,
         "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"},
    ),
    "internvl_chat": (  # the processor turns the template's <image> into <img><IMG_CONTEXT>...</img>
        ("<img>", "</img>", "<IMG_CONTEXT>"),
        {"model_type": "intern_vit_6b"},
        {"image_token_index": "<IMG_CONTEXT>", "downsample_ratio": 0.5, "max_dynamic_patch": 1,
         "use_thumbnail": False, "force_image_size": 32},
        {"image_processor_type": "InternVLImageProcessor", "size": 32},
        {"num_image_token": 4, "image_size": 32, "patch_size": 8, "downsample_ratio": 0.5},
    ),
}  # fmt: skip
_TEXT: dict[str, dict[str, Any]] = {  # the language model under each family's vision tower
    "llava": {"model_type": "llama"},
    "smolvlm": {"model_type": "llama"},
    "idefics3": {"model_type": "llama"},
    "llava_next": {"model_type": "llama"},
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 16, "sliding_window": 512,
               "sliding_window_pattern": 2, "mm_tokens_per_image": 4},
    "mistral3": {"model_type": "mistral", "rope_theta": 10000.0},
    "gemma4": {"model_type": "gemma4_text", "global_head_dim": 16, "num_kv_shared_layers": 0,
               "hidden_size_per_layer_input": 16, "layer_types": ["sliding_attention", "full_attention"],
               "sliding_window": 512, "use_double_wide_mlp": False,
               "rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                      "partial_rotary_factor": 0.25},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "internvl_chat": {"model_type": "qwen3"},
}  # fmt: skip
_SLOT = {
    "gemma3": "<start_of_image>",
    "gemma4": "<|image|>",
    "mistral3": "[IMG]",
}  # what the chat template writes for an image; else "<image>"


_GAINS = {  # `sensitive` gains on top of tiny.sharpen's, where a family's norms undo those
    "gemma4": {("language_model.", "post_attention_layernorm"): 4.0,
               ("language_model.", "post_feedforward_layernorm"): 4.0, ("embed_vision.", ""): 4.0,
               ("vision_tower.patch_embedder.input_proj", ""): 4.0},
}  # fmt: skip
_NAMED = {  # the special tokens a family's processor reads as tokenizer attributes, in order
    "gemma3": ("image_token", "boi_token", "eoi_token"),
    "gemma4": ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token",
               "video_token"),
}  # fmt: skip


def make_vision_family(out: Path, kind: str, seed: int, sensitive: bool, hidden: int = 64) -> Path:
    """A small language model under a family's vision tower, saved with the family's processor;
    four heads of `hidden` / 4 dims (16 by default; 128 makes the 32-dim heads a quantized KV
    cache needs, for the families whose config does not set its own)."""
    import mlx.core as mx

    specials, vision, top, image_processor, processor = _VISION[kind]
    template = CHAT_TEMPLATE.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", _SLOT.get(kind, "<image>")
    )
    attributes = _NAMED.get(kind)
    named = dict(zip(attributes, specials, strict=False)) if attributes else None
    vocab = build_tokenizer(out, extra=specials, template=template, named=named)
    ids = token_ids(out)
    text = {
        **text_config(vocab, ids, hidden=hidden, layers=2, heads=4),
        "head_dim": hidden // 4,
        **_TEXT[kind],
    }
    if "hidden_size_per_layer_input" in text:  # Gemma 4's per-layer token embeddings
        text["vocab_size_per_layer_input"] = vocab
    config = {
        "model_type": kind, "text_config": text, "vocab_size": vocab, "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
        "vision_config": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8, **vision},
        **{k: ids[v] if isinstance(v, str) and v in ids else v for k, v in top.items()},
    }  # fmt: skip
    mx.random.seed(seed)
    model = build_vlm(config)
    store(model, config, out, sensitive, _GAINS.get(kind))
    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, "resample": 3}  # fmt: skip
    write_json(out / "preprocessor_config.json", {**common, **image_processor})
    write_json(out / "processor_config.json", processor)
    write_json(out / "chat_template.json", {"chat_template": template})
    write_generation_config(out, ids)
    return out


def make_qwen3_vl(out: Path, vocab: int, ids: dict[str, int], sensitive: bool, moe: bool = False) -> Path:
    """A tiny Qwen3-VL: interleaved mRoPE, 16-pixel patches, DeepStack features from the
    first vision block fed to the first language layer (4 tokens per 64² image). `moe`: the
    Qwen3-VL-MoE language model (4 experts, 2 a token, in every layer)."""

    family = "qwen3_vl_moe" if moe else "qwen3_vl"
    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = {"model_type": f"{family}_text", **text_config(vocab, ids, hidden=64, layers=2, heads=4),
            "head_dim": 16, "rope_theta": 10000.0, "rope_scaling": rope}  # fmt: skip
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                    moe_intermediate_size=64)  # fmt: skip
    architecture = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    config = {
        "model_type": family, "architectures": [architecture], "text_config": text,
        "vision_config": {"model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "in_channels": 3,
                          "deepstack_visual_indexes": [0]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "tie_word_embeddings": True, "vocab_size": vocab,
    }  # fmt: skip
    model = build_vlm(config)
    store(model, config, out, sensitive)
    _write_qwen3_processor(out, ids)
    return out


def _write_qwen3_processor(out: Path, ids: dict[str, int]) -> None:
    """Qwen3-VL's processor files: 16-pixel patches, 2x2 merge, 64² images (4 tokens)."""
    side = 64
    write_json(
        out / "preprocessor_config.json",
        {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
         "min_pixels": side * side, "max_pixels": side * side, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    )  # fmt: skip
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_generation_config(out, ids)


def make_mtp_pair(out: Path, seed: int, sensitive: bool = False) -> Path:
    """A tiny qwen3_5 target (text hidden 64, 2 layers, one full-attention and one linear-
    attention layer, a 1-layer vision tower) and its qwen3_5_mtp drafter (one MTP layer,
    borrowing the target's embeddings and head)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    target, drafter = out / "target", out / "drafter"
    vocab = build_tokenizer(target)
    build_tokenizer(drafter)
    ids = token_ids(target)
    text = {
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 2,
        "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "eos_token_id": ids["<|im_end|>"],
        "mtp_num_hidden_layers": 1,
        # mRoPE sections add up to half the rotary dims (head_dim x partial_rotary_factor).
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5},
    }  # fmt: skip
    config = {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "in_channels": 3},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "tie_word_embeddings": True,
    }  # fmt: skip
    mx.random.seed(seed)
    model = build_vlm(config)
    if sensitive:
        sharpen(model)
    head_config = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": 3}
    head = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict(json.loads(json.dumps(head_config))))
    mx.eval(model.parameters(), head.parameters())
    head_weights = dict(tree_flatten(head.parameters()))
    # Saved in MLX layout (metadata "mlx"), which mlx-vlm's MTP splitter reads as is.
    weights = {**dict(tree_flatten(model.parameters())), **{f"mtp.{k}": v for k, v in head_weights.items()}}
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    mx.save_safetensors(str(drafter / "model.safetensors"), head_weights, metadata={"format": "mlx"})
    write_json(target / "config.json", config)
    write_json(drafter / "config.json", head_config)
    _write_qwen3_processor(target, ids)
    return out


VISION_KINDS = tuple(_VISION)

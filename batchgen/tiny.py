"""Tiny checkpoints built offline: a BPE tokenizer and random qwen2 / qwen2_vl weights.

No model can be downloaded in CI or on an air-gapped box, so tests and the sample run use
these. They are real architectures saved the way Hugging Face checkpoints are, so the
ordinary loaders (`mlx_lm.load`, `mlx_vlm.load`) are the code path exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_tokenizer", "make_tiny_model"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's template, trimmed: content parts render in the order given, so a row whose
# media come first shares its image prefix with every other question on that image.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "a an the this that is are was were be of in on at to for with by from and or but not "
    "what which who where when why how describe image picture photo video frame scene shows "
    "there here it its they them he she we you i my your our their color colour shape size "
    "red green blue yellow white black orange purple pink brown gray grey dark light bright "
    "circle square triangle star line dot box round small large big tiny huge left right top "
    "bottom center middle corner background foreground object objects person people dog cat "
    "car tree house sky sea water road city street table chair book cup phone computer screen "
    "one two three four five six seven eight nine ten many few some all none each every "
    "answer question caption summary text word sentence story poem list name number count "
    "please write give tell explain short long brief detailed simple clear good bad new old "
    "hello world yes no maybe very quite more most less least first last next before after "
    "system user assistant model data batch generate output input result token time day night"
).split()


def _corpus(seed: int, n_sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 2048)}"
        lines.append(sentence)
    return lines


def build_tokenizer(
    out_dir: Path,
    vocab_size: int = 1024,
    seed: int = 0,
    extra: tuple[str, ...] = (),
    template: str = CHAT_TEMPLATE,
    named: dict[str, str] | None = None,
) -> int:
    """Train a byte-level BPE and save it as a Hugging Face fast tokenizer; return vocab size.
    `extra`: a family's own special tokens (`<image>`), after the Qwen ones; `named`: those
    its processor reads as tokenizer attributes (`image_token`, `boi_token`, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": [*SPECIAL_TOKENS[1:], *extra],
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        **({"extra_special_tokens": named} if named else {}),
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    return tok.get_vocab_size()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _token_ids(out_dir: Path) -> dict[str, int]:
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    added = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    return {tok: ids.get(tok, vocab.get(tok)) for tok in [*SPECIAL_TOKENS, *ids]}


def _text_config(vocab: int, ids: dict[str, int], hidden: int, layers: int, heads: int) -> dict:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "float32",
    }


def _save_weights(model, out_dir: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


KINDS = (
    "lm", "vlm", "qwen2_5_vl", "qwen3_vl", "text-draft", "mtp-pair", "llava", "llava_next", "smolvlm",
    "gemma3", "mistral3", "internvl_chat",
)  # fmt: skip


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
    `kind="vlm"` is a qwen2_vl model (hidden 64, 2 layers, vision depth 2) for mlx-vlm,
    whose processor sees `image_size`² pixels (so 4 image tokens at the default 56);
    `kind="qwen2_5_vl"` the same with Qwen2.5-VL's windowed vision tower.
    Benchmarks pass larger `hidden`, `layers` and `vision_embed` so prefill costs something.
    `kind="text-draft"` is a smaller qwen2 with the same tokenizer, a draft model for "lm";
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
        return _make_mtp_pair(out, seed, sensitive)
    if kind in _VISION:
        return _make_vision_family(out, kind, seed, sensitive)
    vocab = build_tokenizer(out)  # one tokenizer for every kind, so drafts can pair with targets
    ids = _token_ids(out)
    mx.random.seed(seed)
    if kind == "text-draft":
        kind, hidden, layers = "lm", hidden or 64, layers or 2
    if kind == "lm":
        from mlx_lm.models import qwen2

        config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
        config.update(_text_config(vocab, ids, hidden=hidden or 128, layers=layers or 4, heads=4))
        model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    elif kind == "qwen3_vl":
        return _make_qwen3_vl(out, vocab, ids, sensitive)
    elif kind in ("vlm", "qwen2_5_vl"):
        from mlx_vlm.models import qwen2_vl

        qwen2_5 = kind == "qwen2_5_vl"

        text = _text_config(vocab, ids, hidden=hidden or 64, layers=layers or 2, heads=4)
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        # mRoPE sections must add up to half the head dim.
        section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]
        text["rope_scaling"] = {"type": "mrope", "mrope_section": section}
        config = {
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
                "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": vision_embed,
                "intermediate_size": vision_embed * 2, "out_hidden_size": text["hidden_size"], "num_heads": 2,
                "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1], "spatial_merge_size": 2,
                "temporal_patch_size": 2, "in_channels": 3,
            }  # fmt: skip
            model = _build_vlm(config)
        else:
            # Build the config objects the way mlx_vlm.load does, so what we save is what it loads.
            model_config = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
            model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
            model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
            model = qwen2_vl.Model(model_config)
        pixels = image_size * image_size
        _write_json(
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
        _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (expected one of {', '.join(KINDS)})")
    _store(model, config, out, sensitive)
    _write_generation_config(out, ids)
    return out


def _store(model, config: dict, out: Path, sensitive: bool) -> None:
    """The weights (made sensitive if asked) and the config, as mlx-vlm / mlx-lm load them."""
    import mlx.core as mx

    if sensitive:
        _sharpen(model)
    mx.eval(model.parameters())
    _save_weights(model, out)
    _write_json(out / "config.json", config)


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


def _make_qwen3_vl(out: Path, vocab: int, ids: dict[str, int], sensitive: bool) -> Path:
    """A tiny Qwen3-VL: interleaved mRoPE, 16-pixel patches, DeepStack features from the
    first vision block fed to the first language layer (4 tokens per 64² image)."""

    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = {"model_type": "qwen3_vl_text", **_text_config(vocab, ids, hidden=64, layers=2, heads=4),
            "head_dim": 16, "rope_theta": 10000.0, "rope_scaling": rope}  # fmt: skip
    config = {
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "in_channels": 3,
                          "deepstack_visual_indexes": [0]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "tie_word_embeddings": True, "vocab_size": vocab,
    }  # fmt: skip
    model = _build_vlm(config)
    _store(model, config, out, sensitive)
    _write_qwen3_processor(out, ids)
    return out


def _write_qwen3_processor(out: Path, ids: dict[str, int]) -> None:
    """Qwen3-VL's processor files: 16-pixel patches, 2x2 merge, 64² images (4 tokens)."""
    side = 64
    _write_json(
        out / "preprocessor_config.json",
        {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
         "min_pixels": side * side, "max_pixels": side * side, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    )  # fmt: skip
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    _write_generation_config(out, ids)


def _sharpen(model) -> None:
    from mlx.utils import tree_flatten

    gains = {"layers.": 3.0, "merger.": 4.0}
    weights = [
        (name, w * gain)
        for name, w in tree_flatten(model.parameters())
        for part, gain in gains.items()
        if part in name and name.endswith("weight") and "norm" not in name and ".ln" not in name
        and "vision_tower.blocks" not in name
    ]  # fmt: skip
    model.load_weights(weights, strict=False)


def _write_generation_config(out: Path, ids: dict[str, int]) -> None:
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
    )


def _build_vlm(config: dict):
    """A model object built the way mlx_vlm.load builds it, from a config dict."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))
    model_class, _ = get_model_and_args(config=config)
    for key in ("text_config", "vision_config", "audio_config"):
        config.setdefault(key, {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config, ["text", "vision", "audio"])
    return model_class.Model(model_config)


# Per family: special tokens, vision config, top-level config, processor files (32² images, patch 8).
_VISION = {
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
_TEXT = {  # the language model under each family's vision tower
    "llava": {"model_type": "llama"},
    "smolvlm": {"model_type": "llama"},
    "llava_next": {"model_type": "llama"},
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 16, "sliding_window": 512,
               "sliding_window_pattern": 2, "mm_tokens_per_image": 4},
    "mistral3": {"model_type": "mistral", "rope_theta": 10000.0},
    "internvl_chat": {"model_type": "qwen3"},
}  # fmt: skip
_SLOT = {
    "gemma3": "<start_of_image>",
    "mistral3": "[IMG]",
}  # what the chat template writes for an image; else "<image>"


def _make_vision_family(out: Path, kind: str, seed: int, sensitive: bool) -> Path:
    """A small language model under a family's vision tower, saved with the family's processor."""
    import mlx.core as mx

    specials, vision, top, image_processor, processor = _VISION[kind]
    template = CHAT_TEMPLATE.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", _SLOT.get(kind, "<image>")
    )
    named = (
        dict(zip(("image_token", "boi_token", "eoi_token"), specials, strict=True))
        if kind == "gemma3"
        else None
    )
    vocab = build_tokenizer(out, extra=specials, template=template, named=named)
    ids = _token_ids(out)
    text = {**_text_config(vocab, ids, hidden=64, layers=2, heads=4), "head_dim": 16, **_TEXT[kind]}
    config = {
        "model_type": kind, "text_config": text, "vocab_size": vocab, "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
        "vision_config": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8, **vision},
        **{k: ids[v] if isinstance(v, str) and v in ids else v for k, v in top.items()},
    }  # fmt: skip
    mx.random.seed(seed)
    model = _build_vlm(config)
    _store(model, config, out, sensitive)
    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "do_convert_rgb": True, "resample": 3}  # fmt: skip
    _write_json(out / "preprocessor_config.json", {**common, **image_processor})
    _write_json(out / "processor_config.json", processor)
    _write_json(out / "chat_template.json", {"chat_template": template})
    _write_generation_config(out, ids)
    return out


def _make_mtp_pair(out: Path, seed: int, sensitive: bool = False) -> Path:
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
    ids = _token_ids(target)
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
    model = _build_vlm(config)
    if sensitive:
        _sharpen(model)
    head_config = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": 3}
    head = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict(json.loads(json.dumps(head_config))))
    mx.eval(model.parameters(), head.parameters())
    head_weights = dict(tree_flatten(head.parameters()))
    # Saved in MLX layout (metadata "mlx"), which mlx-vlm's MTP splitter reads as is.
    weights = {**dict(tree_flatten(model.parameters())), **{f"mtp.{k}": v for k, v in head_weights.items()}}
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    mx.save_safetensors(str(drafter / "model.safetensors"), head_weights, metadata={"format": "mlx"})
    _write_json(target / "config.json", config)
    _write_json(drafter / "config.json", head_config)
    _write_qwen3_processor(target, ids)
    return out

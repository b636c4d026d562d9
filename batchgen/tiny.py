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
    "lm", "vlm", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "text-draft", "mtp-pair", "llava", "llava_next",
    "smolvlm", "idefics3", "gemma3", "gemma4", "mistral3", "internvl_chat",
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
    from . import tiny_families as families

    if kind == "mtp-pair":
        return families.make_mtp_pair(out, seed, sensitive)
    if kind in families.VISION_KINDS:
        return families.make_vision_family(out, kind, seed, sensitive)
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
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):
        return families.make_qwen3_vl(out, vocab, ids, sensitive, moe=kind == "qwen3_vl_moe")
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


def _store(model, config: dict, out: Path, sensitive: bool, gains: dict | None = None) -> None:
    """The weights (made sensitive if asked, with a family's own `gains`) and the config, as
    mlx-vlm / mlx-lm load them."""
    import mlx.core as mx

    if sensitive:
        _sharpen(model, gains)
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


def _sharpen(model, more: dict[tuple[str, str], float] | None = None) -> None:
    """Language layers x3 and the vision merger x4; `more`: gains by (name prefix, part of the
    name) on top, for families whose norms would undo those (Gemma's post-norms)."""
    from mlx.utils import tree_flatten

    gains = {"layers.": 3.0, "merger.": 4.0}
    params = tree_flatten(model.parameters())
    weights = dict(
        (name, w * gain)
        for name, w in params
        for part, gain in gains.items()
        if part in name and name.endswith("weight") and "norm" not in name and ".ln" not in name
        and "vision_tower.blocks" not in name
    )  # fmt: skip
    for name, w in params:
        for (prefix, part), gain in (more or {}).items():
            if name.startswith(prefix) and part in name:
                weights[name] = weights.get(name, w) * gain
    model.load_weights(list(weights.items()), strict=False)


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

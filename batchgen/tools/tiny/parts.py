"""What every tiny checkpoint is made of: tokenizer, chat template, config, weights.

A BPE tokenizer trained here on a fixed word list, the chat template, the config and weight
files as Hugging Face checkpoints hold them, and the "sensitive" sharpening that makes a random
model's output depend on its input.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, cast

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "THINK_TOKENS",
    "THINKING_TEMPLATE",
    "TOOL_WORDS",
    "CHANNEL_TOKENS",
    "CHANNEL_WORDS",
    "CHANNEL_TEMPLATE",
    "WORDS",
    "build_tokenizer",
    "write_json",
    "token_ids",
    "text_config",
    "store",
    "sharpen",
    "write_generation_config",
    "build_vlm",
]

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


THINK_TOKENS = ("<think>", "</think>")  # mlx-lm's TokenizerWrapper finds a thinking model by these
# Qwen3's `enable_thinking`: false writes an empty closed block after the generation prompt, so
# the answer starts at once; true opens the block in the prompt (as QwQ's and DeepSeek-R1's
# templates do), so even a random model reasons; undefined leaves the model to open it.
# ... and Qwen3's tools: listed in a system turn, called as `<tool_call>` JSON (mlx-lm infers
# its json_tools parser from `<tool_call>` and `tool_call.name` in the template).
TOOL_WORDS = ("<tool_call>", "</tool_call>")  # plain tokens, as in Qwen's vocabulary
_TOOLS_TURN = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{% endif %}"
)
_CALLS_MADE = (
    "{% for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function or tool_call %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}"
)
THINKING_TEMPLATE = (
    CHAT_TEMPLATE.replace("{% for message in messages %}", _TOOLS_TURN + "{% for message in messages %}")
    .replace("<|im_end|>\n{% endfor %}", _CALLS_MADE + "<|im_end|>\n{% endfor %}")
    .replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        "{% elif enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
        "{% endif %}",
    )
)
# Gemma 4's markers: `<|channel>thought` opens a block (two tokens), `<channel|>` closes it;
# `enable_thinking` puts `<|think|>` in the first turn, and the model opens the block itself.
CHANNEL_TOKENS = ("<|channel>", "<channel|>", "<|think|>")
CHANNEL_WORDS = ("thought",)  # one token, as in Gemma 4's vocabulary: `<|channel>thought` is two
CHANNEL_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% if enable_thinking is defined and enable_thinking %}<|think|>{% endif %}"
    "{% for message in messages %}",
)


WORDS = (
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
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
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
    words: tuple[str, ...] = (),
) -> int:
    """Train a byte-level BPE and save it as a Hugging Face fast tokenizer; return vocab size.
    `extra`: a family's own special tokens (`<image>`), after the Qwen ones; `named`: those
    its processor reads as tokenizer attributes (`image_token`, `boi_token`, ...); `words`: plain
    tokens added after training (decoded as text, unlike special ones)."""
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
    tok.add_tokens(list(words))
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
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    return tok.get_vocab_size()


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def token_ids(out_dir: Path) -> dict[str, int]:
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    added = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    return {tok: ids.get(tok, vocab.get(tok)) for tok in [*SPECIAL_TOKENS, *ids]}


def text_config(vocab: int, ids: dict[str, int], hidden: int, layers: int, heads: int) -> dict:
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


def store(model, config: dict, out: Path, sensitive: bool, gains: dict | None = None) -> None:
    """The weights (made sensitive if asked, with a family's own `gains`) and the config, as
    mlx-vlm / mlx-lm load them."""
    import mlx.core as mx

    if sensitive:
        sharpen(model, gains)
    mx.eval(model.parameters())
    _save_weights(model, out)
    write_json(out / "config.json", config)


def sharpen(model, more: dict[tuple[str, str], float] | None = None) -> None:
    """Language layers x3 and the vision merger x4; `more`: gains by (name prefix, part of the
    name) on top, for families whose norms would undo those (Gemma's post-norms)."""
    from mlx.utils import tree_flatten

    gains = {"layers.": 3.0, "merger.": 4.0}
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    weights = dict(
        (name, w * gain)
        for name, w in params
        for part, gain in gains.items()
        if part in name
        and name.endswith("weight")
        and "norm" not in name
        and ".ln" not in name
        and "vision_tower.blocks" not in name
    )
    for name, w in params:
        for (prefix, part), gain in (more or {}).items():
            if name.startswith(prefix) and part in name:
                weights[name] = weights.get(name, w) * gain
    model.load_weights(list(weights.items()), strict=False)


def write_generation_config(out: Path, ids: dict[str, int]) -> None:
    write_json(
        out / "generation_config.json",
        {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]},
    )


def build_vlm(config: dict):
    """A model object built the way mlx_vlm.load builds it, from a config dict."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))
    model_class, _ = get_model_and_args(config=config)
    for key in ("text_config", "vision_config", "audio_config"):
        config.setdefault(key, {})
    model_config = model_class.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, model_class, config, ["text", "vision", "audio"])
    return model_class.Model(model_config)

